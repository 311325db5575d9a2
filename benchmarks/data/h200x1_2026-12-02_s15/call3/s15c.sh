#!/usr/bin/env bash
# session 15, 1 x H200, call 3: the lowering process started first in the constructor and asked
# for the work list at once. CUDA tests; the loop beside the thread (default switch interval
# 0.5 ms), which also puts both cases' kernel variants in the Triton cache; host_only first
# calls right after construction (and one with an empty Triton cache); nereus train control
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s15c.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s15c.tgz -C $O .; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
i() {  # i NAME CASE LAYERS [env...]
  local name=$1 case=$2 layers=$3; shift 3
  (cd benchmarks/multi_gpu && env X=1 "$@" timeout 100 python3 ahead_interference.py --moe $case --layers $layers --json-out $O/$name.json > $O/$name.log 2>&1); step $name $?
  grep -v "^{" $O/$name.log | tail -6 | cut -c1-300 | sed "s/^/$name /"
}
i ti_1 train-ep2-tp2 6
i gi_1 gen-ep2-tp2 24
i ti_2 train-ep2-tp2 6
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 100 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first calls" $O/$name.log | sed "s/^/$name /" | cut -c1-400
}
h t6_now_proc1 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_proc2 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_proc3 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_thread 6 5 NEREUS_AHEAD_PROCESS=0 -- --moe train-ep2-tp2
h g24_now_proc1 24 5 X=1 -- --moe gen-ep2-tp2
h g24_now_proc2 24 5 X=1 -- --moe gen-ep2-tp2
h t6_wait_proc 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_now_proc_fresh 6 5 TRITON_CACHE_DIR=/tmp/tc_c -- --moe train-ep2-tp2
timeout 150 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
ps -eo pid,args | grep -c "nereus.runtime.lowerer\|nereus.backends.proof" >> $O/steps.txt
tar czf $OUT/s15c.tgz -C $O .
cat $O/steps.txt
