#!/usr/bin/env bash
# session 19, 1 x H200, call 2: CUDA tests of HEAD; host_only first calls right after
# construction (default settings), alternating three trees in separate processes:
# base (46ae80c, session 18's final), warm (base + 016016c alone: Triton's compiler
# started at construction), new (HEAD c4f8419: one replay per step, + the compiler
# started, + take finishing a begun pair's replays in the caller)
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s19b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s19b.tgz -C $O .; }
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_allocator_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_room_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
ROOT=$PWD
h() {  # h NAME TREE LAYERS REPEATS -- args
  local name=$1 tree=$2 layers=$3 reps=$4; shift 5
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir/benchmarks/multi_gpu && PYTHONPATH=$dir:/tmp/site timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
h t6_warmup new 6 2 -- --moe train-ep2-tp2
for k in 1 2 3 4 5 6; do
  if [ $((k % 2)) = 1 ]; then order="base warm new"; else order="new warm base"; fi
  for t in $order; do h t6_${t}_$k $t 6 5 -- --moe train-ep2-tp2; done
done
for k in 1 2; do for t in base new; do h g24_${t}_$k $t 24 5 -- --moe gen-ep2-tp2; done; done
tar czf $OUT/s19b.tgz -C $O .
cat $O/steps.txt
