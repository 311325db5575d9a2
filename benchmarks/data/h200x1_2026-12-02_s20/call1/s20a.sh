#!/usr/bin/env bash
# session 20, 1 x H200, call 1: (1) every CUDA test on HEAD (fdc873f: the commits of session 19
# not yet run on a GPU); (2) an empty Triton cache (each run its own new cache directory): the
# warm-only tree (46ae80c + 016016c) against HEAD, alternating; (3) HEAD with a warm cache,
# for the step log's names
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s20a.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20a.tgz -C $O .; }
timeout 230 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_allocator_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_room_cuda.py tests/backends/test_pack_upload.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
ROOT=$PWD
h() {  # h NAME TREE CACHE
  local name=$1 tree=$2 cache=$3
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir/benchmarks/multi_gpu && TRITON_CACHE_DIR=$cache PYTHONPATH=$dir:/tmp/site timeout 45 python3 host_only.py --layers 6 --repeats 5 --json-out $O/$name.json --moe train-ep2-tp2 > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
for k in 1 2 3; do
  if [ $((k % 2)) = 1 ]; then order="warm new"; else order="new warm"; fi
  for t in $order; do h t6_empty_${t}_$k $t /tmp/tc_empty_${t}_$k; done
done
for k in 1 2 3; do h t6_warmcache_new_$k new /tmp/tc_empty_new_1; done
tar czf $OUT/s20a.tgz -C $O .
cat $O/steps.txt
