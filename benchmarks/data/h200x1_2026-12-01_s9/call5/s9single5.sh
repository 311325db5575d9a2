#!/usr/bin/env bash
# session 9, 1 x H200, call 5: the final code (12eb351): every CUDA test, nereus train into and out of
# offload on NCCL against --control (device_state now copies), offload_check on one rank
O=/tmp/o5; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
T0=$(date +%s.%N)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(python3 -c "import time;print(round(time.time()-$T0,1))") s" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt

cp .devrun/s9single5.sh $O/
rm -rf $O/train_offload; tar czf $OUT/single5.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; tail -c 400 $O/train_offload.log; echo; grep -h "^\[" $O/offload1.log | tail -3
