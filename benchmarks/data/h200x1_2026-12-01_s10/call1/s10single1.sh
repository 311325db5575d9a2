#!/usr/bin/env bash
# session 10, 1 x H200, call 1: CUDA tests on 1cc2b05 (+ host_only.py); host work of rank 0's TP <-> DP
# program with no peer (fake process group), 8 and 32 layers, plain and under cProfile
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
cd benchmarks/multi_gpu
timeout 120 python3 host_only.py --layers 8 --repeats 15 --profile $O/prof8.txt --json-out $O/ho8.json > $O/ho8.log 2>&1; echo "ho8 rc=$?" >> $O/steps.txt
timeout 150 python3 host_only.py --layers 32 --repeats 7 --profile $O/prof32.txt --json-out $O/ho32.json > $O/ho32.log 2>&1; echo "ho32 rc=$?" >> $O/steps.txt
cd ../..
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
cp .devrun/s10single1.sh $O/
tar czf $OUT/single1.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; grep -h "^plain\|^profiled" $O/ho8.log $O/ho32.log; tail -5 $O/ho32.log | cut -c1-300
