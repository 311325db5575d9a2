#!/usr/bin/env bash
# session 10, 1 x H200, call 6: every CUDA test file of the runtime on the final tree (after the review fixes)
O=/tmp/o6; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
(cd benchmarks/multi_gpu && timeout 120 python3 host_only.py --layers 8 --repeats 15 --json-out $O/ho8.json > $O/ho8.log 2>&1; echo "ho8 rc=$?" >> $O/steps.txt)
T0=$(date +%s)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(( $(date +%s) - T0 )) s" >> $O/steps.txt
rm -rf $O/train_offload
cp .devrun/s10single6.sh $O/
tar czf $OUT/single6.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit.log; grep -h "^plain" $O/ho8.log; tail -c 300 $O/train_offload.log
