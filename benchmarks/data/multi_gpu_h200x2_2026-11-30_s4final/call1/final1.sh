#!/usr/bin/env bash
# session 4 final call (2 x H200): the merged tree, every GPU figure this session changed
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
NEREUS='from nereus.cli import nereus; nereus()'
BUDGET=${BUDGET:-430}
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
step correctness 120 $R $MG/correctness.py --quick --json-out $O/correctness.json
step moe6 150 $R $MG/moe_reshard.py --layers 6 --repeats 3 --json-out $O/moe_reshard_6l.json
step reshard 150 $R $MG/reshard.py --quick --dcp-layers 0 --skip-gather-scatter --modes device --json-out $O/reshard.json
step zero 120 python3 -c "$NEREUS" train examples/rl/grpo-zero-2gpu.nir --algo grpo --nproc 2 --steps 8 --events "2:Z3,4:T,6:Z1R" --control --backend nccl --out /tmp/zero --json
tail -1 $O/zero.log > $O/zero.json
step offload 90 $R $MG/offload_check.py --json-out $O/offload.json
step moe48 200 $R $MG/moe_reshard.py --repeats 3 --json-out $O/moe48.json
tar czf $OUT/final1.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
grep -h "^\[" $O/*.log | cut -c1-300 | tail -60
