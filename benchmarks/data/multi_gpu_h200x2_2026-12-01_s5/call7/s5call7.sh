#!/usr/bin/env bash
# session 5 call 7 (2 x H200): final figures on the final tree, defaults
O=/tmp/o; mkdir -p $O/prof
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
BUDGET=${BUDGET:-300}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; nvidia-smi topo -m >> $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
step() {  # step NAME CAP command...: runs under min(CAP, what is left of BUDGET)
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
step correctness 100 $R $MG/correctness.py --quick --json-out $O/correctness.json
step reshard 90 $R $MG/reshard.py --quick --dcp-layers 0 --skip-gather-scatter --modes device --json-out $O/reshard.json
step weight_sync 60 $R $MG/weight_sync.py --quick --repeats 9 --json-out $O/weight_sync.json
step dtensor_L8 50 $R $MG/dtensor_compare.py --layers 8 --repeats 11 --json-out $O/dtensor_L8.json
step dtensor_L32 50 $R $MG/dtensor_compare.py --layers 32 --repeats 11 --json-out $O/dtensor_L32.json
step dtensor_L2 40 $R $MG/dtensor_compare.py --layers 2 --repeats 11 --json-out $O/dtensor_L2.json
step offload 40 $R $MG/offload_check.py --json-out $O/offload.json
step moe_gen 50 $R $MG/moe_reshard.py --layers 6 --repeats 5 --cases gen-ep2-tp2 --json-out $O/moe_gen.json
python3 $MG/size_fit.py $O/dtensor_L2.json $O/dtensor_L8.json $O/dtensor_L32.json > $O/size_fit.log 2>&1
tar czf $OUT/call7.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
grep -h "^\[" $O/*.log | cut -c1-250 | tail -50
tail -8 $O/size_fit.log
