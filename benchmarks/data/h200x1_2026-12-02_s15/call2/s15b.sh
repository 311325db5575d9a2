#!/usr/bin/env bash
# session 15, 1 x H200, call 2: the loop beside the thread with the GIL's switch interval
# lowered while a step runs (NEREUS_AHEAD_SWITCH_MS: 0 = Python's 5 ms, 1, 0.5 (default), 0.2);
# host_only first calls with the default (generation after its kernels are in the cache)
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s15b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s15b.tgz -C $O .; }
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_ahead.py -k "not byte_exact" > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
i() {  # i NAME CASE LAYERS [env...]
  local name=$1 case=$2 layers=$3; shift 3
  (cd benchmarks/multi_gpu && env X=1 "$@" timeout 100 python3 ahead_interference.py --moe $case --layers $layers --json-out $O/$name.json > $O/$name.log 2>&1); step $name $?
  grep -v "^{" $O/$name.log | tail -6 | cut -c1-300 | sed "s/^/$name /"
}
for r in 1 2; do
i ti_sw5_$r train-ep2-tp2 6 NEREUS_AHEAD_SWITCH_MS=0
i ti_sw1_$r train-ep2-tp2 6 NEREUS_AHEAD_SWITCH_MS=1
i ti_sw05_$r train-ep2-tp2 6
i ti_sw02_$r train-ep2-tp2 6 NEREUS_AHEAD_SWITCH_MS=0.2
done
i gi_sw5 gen-ep2-tp2 24 NEREUS_AHEAD_SWITCH_MS=0
i gi_sw05 gen-ep2-tp2 24
i gi_sw02 gen-ep2-tp2 24 NEREUS_AHEAD_SWITCH_MS=0.2
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 100 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first calls" $O/$name.log | sed "s/^/$name /" | cut -c1-400
}
h t6_now_proc1 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_proc2 6 5 X=1 -- --moe train-ep2-tp2
h g24_now_proc1 24 5 X=1 -- --moe gen-ep2-tp2
h g24_now_proc2 24 5 X=1 -- --moe gen-ep2-tp2
tar czf $OUT/s15b.tgz -C $O .
cat $O/steps.txt
