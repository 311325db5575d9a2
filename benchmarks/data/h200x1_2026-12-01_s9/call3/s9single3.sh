#!/usr/bin/env bash
# session 9, 1 x H200, call 3: offload_paths.py with OMP_NUM_THREADS=1 (as torchrun sets it for
# 2+ processes per node) and again with the default; every other CUDA test (tests/triton apart:
# its conftest turns the Triton interpreter on for the whole process)
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
OMP_NUM_THREADS=1 timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_paths.py --json-out $O/offload_paths_omp1.json > $O/offload_paths_omp1.log 2>&1; echo "offload_paths omp1 rc=$?" >> $O/steps.txt
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_paths.py --json-out $O/offload_paths.json > $O/offload_paths.log 2>&1; echo "offload_paths rc=$?" >> $O/steps.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
cp .devrun/s9single3.sh $O/
tar czf $OUT/single3.tgz -C $O .
cat $O/steps.txt; grep -v "^{" $O/offload_paths_omp1.log | tail -5; grep -v "^{" $O/offload_paths.log | tail -5; tail -3 $O/unit.log
