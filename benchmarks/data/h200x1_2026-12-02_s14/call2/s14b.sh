#!/usr/bin/env bash
# session 14, 1 x H200, call 2: the lowering-ahead thread's lowering in a lowering process of
# its rank (nereus.runtime.lowerer). CUDA tests; what the thread costs a loop beside it, process vs
# thread (NEREUS_AHEAD_PROCESS=0), with the step trace; host_only first calls (fresh and warm
# Triton cache); nereus train 1-GPU offload against its control
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s14b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s14b.tgz -C $O .; }
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; step unit $?
tail -3 $O/unit.log
i() {  # i NAME CASE LAYERS [env...]
  local name=$1 case=$2 layers=$3; shift 3
  (cd benchmarks/multi_gpu && env X=1 "$@" timeout 150 python3 ahead_interference.py --moe $case --layers $layers --json-out $O/$name.json > $O/$name.log 2>&1); step $name $?
  grep -v "^{" $O/$name.log | tail -6 | cut -c1-300 | sed "s/^/$name /"
}
for r in 1 2; do
i ti_proc$r train-ep2-tp2 6
i ti_thread$r train-ep2-tp2 6 NEREUS_AHEAD_PROCESS=0
i gi_proc$r gen-ep2-tp2 24
i gi_thread$r gen-ep2-tp2 24 NEREUS_AHEAD_PROCESS=0
done
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 120 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
h t6_now_proc_fresh 6 5 TRITON_CACHE_DIR=/tmp/tc_a -- --moe train-ep2-tp2
h t6_now_thread_fresh 6 5 TRITON_CACHE_DIR=/tmp/tc_b NEREUS_AHEAD_PROCESS=0 -- --moe train-ep2-tp2
h t6_now_proc 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_thread 6 5 NEREUS_AHEAD_PROCESS=0 -- --moe train-ep2-tp2
h t6_wait_proc 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h g24_now_proc 24 5 X=1 -- --moe gen-ep2-tp2
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
ps -eo pid,args | grep -c "nereus.runtime.lowerer\|nereus.backends.proof" >> $O/steps.txt
tar czf $OUT/s14b.tgz -C $O .
cat $O/steps.txt
