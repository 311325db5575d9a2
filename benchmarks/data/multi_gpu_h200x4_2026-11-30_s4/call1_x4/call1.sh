#!/usr/bin/env bash
# call 1: ZeRO on NCCL (4), controller MAPE on NCCL (2), correctness --quick (4), MoE profile (2), ws/dt profiles (2)
O=/tmp/o; mkdir -p $O/prof
R="python3 -m torch.distributed.run --standalone"
MG=benchmarks/multi_gpu
NEREUS='from nereus.cli import nereus; nereus()'
nvidia-smi -L > $O/machine.txt; nvidia-smi topo -m >> $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null
python3 -c "import torch,triton;print(torch.__version__, triton.__version__, torch.cuda.nccl.version())" >> $O/machine.txt
t0=$(date +%s)
( CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 benchmarks/controller_real_steps.py --backend nccl > $O/controller.log 2>&1; echo "controller rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
  cp benchmarks/data/controller_real_steps_nccl.json $O/ 2>/dev/null
  CUDA_VISIBLE_DEVICES=0,1 timeout 100 $R --nproc-per-node 2 $MG/weight_sync.py --quick --profile-dir $O/prof --json-out $O/ws_prof.json > $O/ws_prof.log 2>&1; echo "ws_prof rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
  CUDA_VISIBLE_DEVICES=0,1 timeout 100 $R --nproc-per-node 2 $MG/dtensor_compare.py --profile-dir $O/prof --json-out $O/dt_prof.json > $O/dt_prof.log 2>&1; echo "dt_prof rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
) &
( CUDA_VISIBLE_DEVICES=2,3 timeout 220 $R --nproc-per-node 2 $MG/moe_reshard.py --layers 6 --repeats 3 --profile $O/prof --json-out $O/moe_prof.json > $O/moe_prof.log 2>&1; echo "moe rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt ) &
wait
cp $O/prof/profile_moe.txt $OUT/ 2>/dev/null
timeout 170 python3 -c "$NEREUS" train examples/rl/grpo-zero-cpu.nir --algo grpo --nproc 4 --steps 8 --events "2:S2,4:S3,6:S4" --control --backend nccl --out /tmp/zero --json > $O/zero.log 2>&1; echo "zero rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
tail -1 $O/zero.log > $O/zero.json
timeout 120 $R --nproc-per-node 4 $MG/correctness.py --quick --json-out $O/correctness_4.json > $O/correctness_4.log 2>&1; echo "correctness_4 rc=$? $(( $(date +%s)-t0 ))s" >> $O/steps.txt
mkdir -p $O/zero_run; find /tmp/zero -name "*.json" -size -4M -exec cp {} $O/zero_run/ \; 2>/dev/null
tar czf $OUT/call1.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
grep -h "^\[" $O/*.log | cut -c1-300 | tail -40
