#!/usr/bin/env bash
# session 9, 1 x H200, call 4, the final tree: every CUDA test; offload_paths.py (one thread, as a
# 2-process job runs); nereus train on NCCL with a plan that moves ref and reward into host memory
# and back, against --control (no transitions); offload_check.py on one rank
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
OMP_NUM_THREADS=1 timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_paths.py --json-out $O/offload_paths_omp1.json > $O/offload_paths_omp1.log 2>&1; echo "offload_paths omp1 rc=$?" >> $O/steps.txt
T0=$(date +%s.%N)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(python3 -c "import time;print(round(time.time()-$T0,1))") s" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
rm -rf $O/train_offload/*.pt $O/train_offload/*.png
cp .devrun/s9single4.sh $O/
tar czf $OUT/single4.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; grep -v "^{" $O/offload_paths_omp1.log | tail -5; tail -c 400 $O/train_offload.log; echo; grep -h "^\[" $O/offload1.log | tail -3
