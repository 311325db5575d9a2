#!/usr/bin/env bash
# session 19, 1 x H200, call 1: CUDA tests of HEAD; host_only first calls right after
# construction (default settings), alternating three trees in separate processes:
# base (46ae80c, session 18's final), split (c324467: one replay per step), new
# (HEAD: + Triton's compiler started at construction)
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s19a.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s19a.tgz -C $O .; }
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
  if [ $((k % 2)) = 1 ]; then order="base split new"; else order="new split base"; fi
  for t in $order; do h t6_${t}_$k $t 6 5 -- --moe train-ep2-tp2; done
done
for t in base new; do h g24_${t}_1 $t 24 5 -- --moe gen-ep2-tp2; done
tar czf $OUT/s19a.tgz -C $O .
cat $O/steps.txt
