#!/usr/bin/env bash
# session 9, 2 x H200: offload with the kernels on pinned host memory in place (default) against
# the copying path (NEREUS_MAPPED_HOST=0), interleaved; MoE at 12 layers; the session-8 default
# (deferred destinations off) re-measured on TP <-> DP, weight sync, GPU doubling.
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
NEW=$PWD; SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-530}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; cat $NEW/.devrun/tree.txt >> $O/machine.txt; nvidia-smi topo -m >> $O/machine.txt 2>&1
nproc >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
step() {  # step NAME CAP script args...: under min(CAP, what is left of BUDGET)
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  local s=$1; shift
  (timeout $cap env PYTHONPATH=$NEW:$SITE $R $NEW/benchmarks/multi_gpu/$s "$@" > $O/$name.log 2>&1)
  echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
step offload_new 60 offload_check.py --json-out $O/offload_new.json
export NEREUS_MAPPED_HOST=0; step offload_copying 60 offload_check.py --json-out $O/offload_copying.json; unset NEREUS_MAPPED_HOST
step offload_new2 60 offload_check.py --json-out $O/offload_new2.json
step correctness_new 70 correctness.py --quick --json-out $O/correctness_new.json
step dt8_new 45 dtensor_compare.py --layers 8 --json-out $O/dt8_new.json
step variants_new 90 variants.py --variants default,defer --json-out $O/variants_new.json
step moe_new 150 moe_reshard.py --quick --layers 12 --json-out $O/moe_new.json
step ws_new 60 weight_sync.py --quick --json-out $O/ws_new.json
step dt32_new 60 dtensor_compare.py --layers 32 --repeats 5 --json-out $O/dt32_new.json
step dt8_new2 45 dtensor_compare.py --layers 8 --json-out $O/dt8_new2.json
step reshard_new 100 reshard.py --quick --json-out $O/reshard_new.json
cp $NEW/.devrun/s9x2.sh $O/
tar czf ${OUT:-/tmp}/x2.tgz -C $O --exclude="*.pt" .
cat $O/steps.txt
for f in $O/*.log; do echo "== $f"; grep -h "^\[\|ratio\|bound" $f | cut -c1-200 | tail -5; done
