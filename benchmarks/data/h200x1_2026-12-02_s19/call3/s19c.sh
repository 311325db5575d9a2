#!/usr/bin/env bash
# session 19, 1 x H200, call 3: HEAD 64c28ce (c4f8419 + Ahead.step_log): CUDA tests of
# lowering ahead; host_only first calls right after construction with the thread's step
# log (new), more of the warm-only tree (base + 016016c), and with an empty Triton cache
# (new and base, each run its own empty cache directory)
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s19c.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s19c.tgz -C $O .; }
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
ROOT=$PWD
h() {  # h NAME TREE LAYERS REPEATS [env...] -- args
  local name=$1 tree=$2 layers=$3 reps=$4; shift 4
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir/benchmarks/multi_gpu && env "${envs[@]}" PYTHONPATH=$dir:/tmp/site timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
h t6_warmup new 6 2 X=1 -- --moe train-ep2-tp2
n=0
for k in 1 2 3; do
  for t in new warm new; do n=$((n + 1)); h t6_${t}_$n $t 6 5 X=1 -- --moe train-ep2-tp2; done
done
for k in 1 2 3; do
  for t in new base; do h t6_fresh_${t}_$k $t 6 5 TRITON_CACHE_DIR=/tmp/tc_${t}_$k -- --moe train-ep2-tp2; done
done
for k in 1 2; do h g24_new_$k new 24 5 X=1 -- --moe gen-ep2-tp2; done
tar czf $OUT/s19c.tgz -C $O .
cat $O/steps.txt
