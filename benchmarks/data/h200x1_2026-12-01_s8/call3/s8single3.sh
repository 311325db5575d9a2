#!/usr/bin/env bash
# session 8, 1 x H200: the final packer (keyed calls keep their first views) and control tags (this tree) against 64979c2 (.devrun/old8):
# CUDA tests, pack_plans.py and pack_kernels.py interleaved old/new, offload_check
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
lscpu | grep "Model name" >> $O/machine.txt
NEW=$PWD; OLD=$PWD/.devrun/old8
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
for r in 1 2; do
  for t in old new; do
    P=$NEW; [ $t = old ] && P=$OLD
    PYTHONPATH=$P:/tmp/site timeout 120 python3 benchmarks/multi_gpu/pack_plans.py > $O/plans_${t}_r$r.json 2> $O/plans_${t}_r$r.log; echo "plans $t r$r rc=$?" >> $O/steps.txt
  done
done
for t in old new; do
  P=$NEW; [ $t = old ] && P=$OLD
  PYTHONPATH=$P:/tmp/site timeout 150 python3 benchmarks/pack_kernels.py --out $O/pack_$t.json > $O/pack_$t.log 2>&1; echo "pack_kernels $t rc=$?" >> $O/steps.txt
done
timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/offload_check.py --json-out $O/offload1.json > $O/offload1.log 2>&1; echo "offload1 rc=$?" >> $O/steps.txt
cp .devrun/s8single3.sh $O/
tar czf $OUT/single3.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit.log; tail -n1 -q $O/plans_*.log; grep -h "^\[" $O/offload1.log | tail -3
