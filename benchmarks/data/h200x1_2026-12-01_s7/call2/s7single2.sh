#!/usr/bin/env bash
# session 7, 1 x H200: CUDA tests on the tree with the GC pause (08b1580 + docs); the
# device host's full-collection times for the MoE host-shape case (gloo on its CPUs:
# host figures, no GPU ones), collector paused (default) against NEREUS_PAUSE_GC=0
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; nproc >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
for r in 1 2; do for p in 1 0; do
  NEREUS_PAUSE_GC=$p timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gc_probe.py benchmarks/multi_gpu/moe_reshard.py --backend gloo --device cpu --quick --shape host --layers 6 --repeats 5 --json-out $O/gc_pause${p}_r$r.json > $O/gc_pause${p}_r$r.log 2>&1; echo "gc_pause${p}_r$r rc=$?" >> $O/steps.txt
done; done
cp .devrun/s7single2.sh $O/
tar czf $OUT/single2.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log; grep -h GC_PROBE $O/gc_*.log | cut -c1-120
