#!/usr/bin/env bash
# session 8, 1 x H200: every CUDA test and offload_check on 55ab6e1 (session 7's last look never ran on a GPU)
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
cp .devrun/s8single1.sh $O/
tar czf $OUT/single1.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; grep -h "^\[" $O/offload1.log | tail -3
