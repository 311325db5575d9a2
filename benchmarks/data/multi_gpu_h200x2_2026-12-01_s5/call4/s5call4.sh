#!/usr/bin/env bash
# session 5 call 4 (2 x H200): pinned table uploads (MoE, correctness), and a sweep of the
# stream defaults (data groups x chunk size) on TP -> DP of 8 layers beside DTensor
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
BUDGET=${BUDGET:-300}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
step correctness 100 $R $MG/correctness.py --quick --json-out $O/correctness.json
step moe6 100 $R $MG/moe_reshard.py --layers 6 --repeats 5 --cases gen-ep2-tp2,train-ep2-tp2 --json-out $O/moe_reshard_6l.json
i=0
for cfg in 4:128 2:128 1:128 4:64 4:256 2:256 4:128; do
  g=${cfg%:*}; c=${cfg#*:}; i=$((i + 1))
  step sweep${i}_g${g}_c${c} 40 env NEREUS_P2P_GROUPS=$g NEREUS_P2P_CHUNK_BYTES=$((c << 20)) $R $MG/dtensor_compare.py --layers 8 --repeats 11 --json-out $O/sweep${i}_g${g}_c${c}.json
done
tar czf $OUT/call4.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
grep -h "^\[" $O/moe6.log $O/correctness.log | grep -v "layers\|bandwidth" | cut -c1-220
for f in $O/sweep_*.log; do echo "== $f"; grep -h "tp-dp:\|dp-tp:\|prepared" $f | cut -c1-160; done
