#!/usr/bin/env bash
# session 8, 1 x H200: every CUDA test on the final tree, nereus train on NCCL (one GPU):
# a clean run, an injected step failure (ends with rank 0's own error), --backend nccl --nproc 2 refused before launch
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
T0=$(date +%s.%N)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu.nir --nproc 1 --backend nccl --steps 4 --out $O/train_ok --json > $O/train_ok.log 2>&1; echo "train ok rc=$? $(python3 -c "import time;print(round(time.time()-$T0,1))") s" >> $O/steps.txt
T0=$(date +%s.%N)
NEREUS_STEP_FAULT=0:2 timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu.nir --nproc 1 --backend nccl --steps 4 --out $O/train_fault --json > $O/train_fault.log 2>&1; echo "train fault rc=$? $(python3 -c "import time;print(round(time.time()-$T0,1))") s" >> $O/steps.txt
timeout 100 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu.nir --nproc 2 --backend nccl --steps 2 --out $O/train_two > $O/train_two.log 2>&1; echo "train nproc2 rc=$?" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
cp .devrun/s8single4.sh $O/
tar czf $OUT/single4.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit.log; tail -c 600 $O/train_fault.log; echo; tail -3 $O/train_two.log; grep -h "^\[" $O/offload1.log | tail -3
