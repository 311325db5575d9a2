#!/usr/bin/env bash
# session 17, 1 x H200, call 1: session 16's thread order (first-call work of every pair before
# any replays, LATER/park) and paused_all on the GPU for the first time. CUDA tests; host_only
# first calls right after construction and the way back right after the commit; with the
# thread done; empty Triton cache; the loop beside the thread; nereus train 1-GPU offload
# against its control
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s17a.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s17a.tgz -C $O .; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first calls" $O/$name.log | sed "s/^/$name /" | cut -c1-330
}
for k in 1 2 3 4 5; do h t6_now_$k 6 5 X=1 -- --moe train-ep2-tp2; done
h t6_fresh_1 6 5 TRITON_CACHE_DIR=/tmp/tc_a -- --moe train-ep2-tp2
h t6_fresh_2 6 5 TRITON_CACHE_DIR=/tmp/tc_b -- --moe train-ep2-tp2
h t6_wait_1 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
for k in 1 2 3; do h g24_now_$k 24 5 X=1 -- --moe gen-ep2-tp2; done
i() {  # i NAME CASE LAYERS
  (cd benchmarks/multi_gpu && timeout 60 python3 ahead_interference.py --moe $2 --layers $3 --json-out $O/$1.json > $O/$1.log 2>&1); step $1 $?
  grep -v "^{" $O/$1.log | tail -4 | cut -c1-240 | sed "s/^/$1 /"
}
i ti_1 train-ep2-tp2 6
i ti_2 train-ep2-tp2 6
i gi_1 gen-ep2-tp2 24
timeout 90 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
ps -eo pid,args | grep -c "nereus.runtime.lowerer\|nereus.backends.proof" >> $O/steps.txt
tar czf $OUT/s17a.tgz -C $O .
cat $O/steps.txt
