#!/usr/bin/env bash
# call 3 (2 of the 4 GPUs): executor variants interleaved (twice), then the official weight sync / DTensor scripts
O=/tmp/o3; mkdir -p $O
export CUDA_VISIBLE_DEVICES=0,1
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
t0=$(date +%s)
for i in 1 2; do
  timeout 150 $R $MG/variants.py --repeats 11 --json-out $O/variants_$i.json > $O/variants_$i.log 2>&1; echo "variants_$i rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
done
timeout 100 $R $MG/weight_sync.py --quick --repeats 9 --json-out $O/weight_sync_2.json > $O/weight_sync_2.log 2>&1; echo "weight_sync_2 rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
timeout 100 $R $MG/dtensor_compare.py --repeats 11 --json-out $O/dtensor_2.json > $O/dtensor_2.log 2>&1; echo "dtensor_2 rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
tar czf $OUT/call3.tgz -C $O .
cat $O/steps.txt
grep -h "^\[" $O/*.log | cut -c1-330
