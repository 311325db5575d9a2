#!/usr/bin/env bash
# session 9, 1 x H200: pinned host memory addressed in place by the pack kernels.
# CUDA tests (old list + test_mapped_host_cuda.py), offload_paths.py (in place vs copying),
# offload_check.py on one rank (whole-unit copies, regression)
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py > $O/unit_mapped.log 2>&1; echo "unit mapped rc=$?" >> $O/steps.txt
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_paths.py --json-out $O/offload_paths.json > $O/offload_paths.log 2>&1; echo "offload_paths rc=$?" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py tests/triton > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
cp .devrun/s9single2.sh $O/
tar czf $OUT/single2.tgz -C $O .
cat $O/steps.txt; tail -4 $O/unit_mapped.log; grep -v "^{" $O/offload_paths.log | tail -8; grep -h "^\[" $O/offload1.log | tail -3; tail -3 $O/unit.log
