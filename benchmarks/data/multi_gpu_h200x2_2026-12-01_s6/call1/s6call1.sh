#!/usr/bin/env bash
# session 6 call 1 (2 x H200): where the host time of a warm transition goes
O=/tmp/o; mkdir -p $O/prof
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
BUDGET=${BUDGET:-240}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null
nproc >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
step() {  # step NAME CAP command...: runs under min(CAP, what is left of BUDGET)
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
step host_L8 60 $R $MG/host_profile.py --layers 8 --repeats 15 --out $O/prof/host_L8.txt --json-out $O/host_L8.json
step host_L32 70 $R $MG/host_profile.py --layers 32 --repeats 10 --out $O/prof/host_L32.txt --json-out $O/host_L32.json
step dtensor_L8p 60 $R $MG/dtensor_compare.py --layers 8 --repeats 5 --profile-dir $O/prof --json-out $O/dtensor_L8p.json
tar czf $OUT/call1.tgz -C $O .
cat $O/steps.txt
grep -h "^\[" $O/*.log | cut -c1-250 | tail -30
