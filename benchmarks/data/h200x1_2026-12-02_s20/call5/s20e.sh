#!/usr/bin/env bash
# session 20, 1 x H200, call 5: every CUDA test on HEAD (0e22fb1 + thread_steps.py); then
# HEAD against fdc873f (trees/head), alternating: host_only first calls with an empty Triton
# cache (its own new directory per run), ahead_interference.py (the loop beside the thread),
# the 24-layer generation change
O=/tmp/o5; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt; nproc >> $O/machine.txt
cp .devrun/s20e.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20e.tgz -C $O .; }
timeout 230 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_intraop.py tests/runtime/test_allocator_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_room_cuda.py tests/backends/test_pack_upload.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
ROOT=$PWD
h() {  # h NAME TREE CACHE LAYERS CASE
  local name=$1 tree=$2 cache=$3 layers=$4 case=$5
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir/benchmarks/multi_gpu && TRITON_CACHE_DIR=$cache PYTHONPATH=$dir:/tmp/site timeout 45 python3 host_only.py --layers $layers --repeats 5 --json-out $O/$name.json --moe $case > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
i() {  # i NAME TREE
  local name=$1 tree=$2
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 60 python3 benchmarks/multi_gpu/ahead_interference.py --moe train-ep2-tp2 --layers 6 > $O/$name.log 2>&1); step $name $?
  tail -1 $O/$name.log > $O/$name.json
}
h t6_empty_new_1 new /tmp/tc_e_new_1 6 train-ep2-tp2
h t6_empty_head_1 head /tmp/tc_e_head_1 6 train-ep2-tp2
h t6_empty_head_2 head /tmp/tc_e_head_2 6 train-ep2-tp2
h t6_empty_new_2 new /tmp/tc_e_new_2 6 train-ep2-tp2
i int_head_1 head
i int_new_1 new
i int_new_2 new
i int_head_2 head
h g24_new_1 new /tmp/tc_e_new_1 24 gen-ep2-tp2
h g24_head_1 head /tmp/tc_e_head_1 24 gen-ep2-tp2
tar czf $OUT/s20e.tgz -C $O .
cat $O/steps.txt
