#!/usr/bin/env bash
# session 5 call 3 (2 x H200): A/B of aa0a4ce (last session's measured tree) and HEAD on
# the host-bound cases (MoE ep2 -> tp2, offload), interleaved, same lease
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
BUDGET=${BUDGET:-300}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null; lscpu | grep -i "model name\|MHz" >> $O/machine.txt
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
NEW=$PWD; OLD=$PWD/.devrun/old; SITE=/tmp/site
for round in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then T=$OLD; else T=$NEW; fi
    step moe_${tree}_$round 60 env PYTHONPATH=$T:$SITE $R $T/benchmarks/multi_gpu/moe_reshard.py --layers 6 --repeats 5 --cases gen-ep2-tp2 --json-out $O/moe_${tree}_$round.json
    step offload_${tree}_$round 40 env PYTHONPATH=$T:$SITE $R $T/benchmarks/multi_gpu/offload_check.py --json-out $O/offload_${tree}_$round.json
  done
done
tar czf $OUT/call3.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
cat $O/machine.txt
for f in $O/moe_*.log $O/offload_*.log; do echo "== $f"; grep -h "^\[" $f | grep -v "layers\|bandwidth" | cut -c1-200; done
