#!/usr/bin/env bash
# session 13, 1 x H200, call 2: lowering ahead, host_only first calls with a wait before each (--wait-ahead),
# right after one another, and without the thread: MoE training 6 layers, generation 24 and 6,
# dense TP -> DP 32 layers; phases of the call right after registering
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s13b.sh $O/
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 120 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
  grep -h "^plain a-b\|^first" $O/$name.log | sed "s/^/$name /" | cut -c1-330
  tar czf $OUT/s13b.tgz -C $O .
}
t0=$(date +%s)
for i in 1 2; do
h t6_wait$i 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
done
h t6_now3 6 5 X=1 -- --moe train-ep2-tp2
h g24_wait 24 5 X=1 -- --moe gen-ep2-tp2 --wait-ahead
h g24_now 24 5 X=1 -- --moe gen-ep2-tp2
h g24_off 24 5 NEREUS_LOWER_AHEAD=0 -- --moe gen-ep2-tp2
h g6_wait 6 7 X=1 -- --moe gen-ep2-tp2 --wait-ahead
h g6_off 6 7 NEREUS_LOWER_AHEAD=0 -- --moe gen-ep2-tp2
h d32_wait 32 7 X=1 -- --wait-ahead
h d32_now 32 7 X=1 --
h d32_off 32 7 NEREUS_LOWER_AHEAD=0 --
(cd benchmarks/multi_gpu && PYTHONPATH=$PYTHONPATH:$PWD timeout 100 python3 cold_phases.py $O/pt6_now.json -- --repeats 3 --moe train-ep2-tp2 --layers 6 > $O/pt6_now.log 2>&1); echo "pt6_now rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
grep -h "^first" $O/pt6_now.log | cut -c1-200
tar czf $OUT/s13b.tgz -C $O .
cat $O/steps.txt
