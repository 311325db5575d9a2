#!/usr/bin/env bash
# session 13, 1 x H200, call 5: the prover proves the ways back ahead too. The lowering-ahead CUDA
# test; host_only first calls with the thread done and right after; phases of a thread-done run
O=/tmp/o5; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s13e.sh $O/
t0=$(date +%s)
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py > $O/unit.log 2>&1; echo "unit rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
tail -1 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 100 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
  grep -h "^plain a-b\|^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
  tar czf $OUT/s13e.tgz -C $O .
}
h t6_wait1 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_wait2 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_now1 6 5 X=1 -- --moe train-ep2-tp2
h g24_wait 24 5 X=1 -- --moe gen-ep2-tp2 --wait-ahead
(cd benchmarks/multi_gpu && PYTHONPATH=$PYTHONPATH:$PWD timeout 100 python3 cold_phases.py $O/pt6_wait.json -- --repeats 3 --moe train-ep2-tp2 --layers 6 --wait-ahead > $O/pt6_wait.log 2>&1); echo "pt6_wait rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
grep -h "^first calls:" $O/pt6_wait.log | cut -c1-200
tar czf $OUT/s13e.tgz -C $O .
cat $O/steps.txt
