#!/usr/bin/env bash
# call 4 (2 GPUs): offload re-measure after the pinned-host packing (10f8277) and the 2-GPU reshard on this tree
O=/tmp/o4; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_gpu"
t0=$(date +%s)
timeout 80 $R/offload_check.py --json-out $O/offload_check.json > $O/offload_check.log 2>&1; echo "offload_check rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
timeout 100 $R/reshard.py --quick --dcp-layers 0 --skip-gather-scatter --modes device --json-out $O/reshard_2.json > $O/reshard_2.log 2>&1; echo "reshard_2 rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
tar czf $OUT/call4.tgz -C $O .
cat $O/steps.txt
grep -h "^\[" $O/*.log | cut -c1-300
