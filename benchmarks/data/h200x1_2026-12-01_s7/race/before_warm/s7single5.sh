#!/usr/bin/env bash
# session 7, 1 x H200: the deferred-destination race test without the fix (should fail),
# then with it (.devrun/fix_side_wait.patch), then every CUDA test with it
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt
for i in 1; do
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_executor_cuda.py -k waits_for_work > $O/race_before_$i.log 2>&1; echo "race_before_$i rc=$?" >> $O/steps.txt
done
patch -p1 < .devrun/fix_side_wait.patch > $O/patch.log 2>&1; echo "patch rc=$?" >> $O/steps.txt
for i in 1; do
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_executor_cuda.py -k waits_for_work > $O/race_after_$i.log 2>&1; echo "race_after_$i rc=$?" >> $O/steps.txt
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
cp .devrun/s7single5.sh .devrun/fix_side_wait.patch $O/
tar czf $OUT/single5.tgz -C $O .
cat $O/steps.txt; for f in $O/race_*.log; do echo "== $f"; grep -E "passed|failed|assert " $f | tail -3; done; tail -2 $O/unit.log
