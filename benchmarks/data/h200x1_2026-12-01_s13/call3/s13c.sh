#!/usr/bin/env bash
# session 13, 1 x H200, call 3: what the lowering-ahead thread costs a training loop beside it
# (ahead_interference.py), and more first calls right after registering (host_only, default) and
# without the thread
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s13c.sh $O/
t0=$(date +%s)
for i in 1 2; do
(cd benchmarks/multi_gpu && timeout 150 python3 ahead_interference.py --moe train-ep2-tp2 --layers 6 --json-out $O/interf_t6_$i.json > $O/interf_t6_$i.log 2>&1); echo "interf_t6_$i rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
grep -v "^{" $O/interf_t6_$i.log | tail -4
tar czf $OUT/s13c.tgz -C $O .
done
(cd benchmarks/multi_gpu && timeout 150 python3 ahead_interference.py --moe gen-ep2-tp2 --layers 24 --json-out $O/interf_g24.json > $O/interf_g24.log 2>&1); echo "interf_g24 rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
grep -v "^{" $O/interf_g24.log | tail -4
tar czf $OUT/s13c.tgz -C $O .
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 120 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
  grep -h "^plain a-b\|^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
  tar czf $OUT/s13c.tgz -C $O .
}
for i in 4 5 6; do
h t6_now$i 6 5 X=1 -- --moe train-ep2-tp2
done
h t6_off3 6 5 NEREUS_LOWER_AHEAD=0 -- --moe train-ep2-tp2
h g24_now2 24 5 X=1 -- --moe gen-ep2-tp2
h g24_off2 24 5 NEREUS_LOWER_AHEAD=0 -- --moe gen-ep2-tp2
h g6_now 6 7 X=1 -- --moe gen-ep2-tp2
cat $O/steps.txt
