#!/usr/bin/env bash
# session 6, 1 x H200: offload_check on one GPU (device <-> host copies only), c1183ac vs the
# new tree, interleaved; and this session's CUDA unit tests
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 1"
NEW=$PWD; OLD=$PWD/.devrun/old; SITE=/tmp/site
nvidia-smi -L > $O/machine.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
for round in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then T=$OLD; else T=$NEW; fi
    timeout 100 env PYTHONPATH=$T:$SITE $R $T/benchmarks/multi_gpu/offload_check.py --json-out $O/offload1_${tree}_$round.json > $O/offload1_${tree}_$round.log 2>&1; echo "offload1_${tree}_$round rc=$?" >> $O/steps.txt
  done
done
tar czf $OUT/single3.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit.log
for f in $O/offload1_*.log; do echo "== $f"; grep -h "^\[" $f | cut -c1-160 | tail -5; done
