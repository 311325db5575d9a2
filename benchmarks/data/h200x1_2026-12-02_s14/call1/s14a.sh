#!/usr/bin/env bash
# session 14, 1 x H200, call 1: pack kernels compiled in a child process (compile_child). Does the
# child make a CUDA context; CUDA tests; what the lowering-ahead thread costs a loop beside it, with
# a fresh Triton cache, child vs inline, and where the slow steps come from (--trace-c); host_only
# first calls; nereus train 1-GPU offload against its control (session 13's post-call-5 fixes)
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s14a.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s14a.tgz -C $O .; }
echo "TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-unset} HOME=$HOME" >> $O/machine.txt
TRITON_CACHE_DIR=/tmp/tc_probe timeout 120 python3 -c "
import time, torch
t = time.time()
from nereus.backends.triton import kernels
t1 = time.time(); kernels.compile_only(('pack', 8, 2, 16, 256)); t2 = time.time()
kernels.compile_only(('unpack', 4, 1, 8, 64)); t3 = time.time()
print(f'import {t1-t:.2f} s, first compile {t2-t1:.2f} s, second {t3-t2:.2f} s; primary context {torch._C._cuda_hasPrimaryContext(0)}, cuda initialized {torch.cuda.is_initialized()}')
" > $O/probe.log 2>&1; step probe $?
cat $O/probe.log | tail -3
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_compile_child_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_ahead.py tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; step unit $?
tail -3 $O/unit.log
n=0
i() {  # i NAME CASE LAYERS [env...] -- args
  local name=$1 case=$2 layers=$3; shift 3; n=$((n+1))
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env TRITON_CACHE_DIR=/tmp/tc_$name "${envs[@]}" timeout 150 python3 ahead_interference.py --moe $case --layers $layers --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -v "^{" $O/$name.log | tail -9 | cut -c1-600 | sed "s/^/$name /"
}
i ti_child train-ep2-tp2 6 X=1 --
i ti_inline train-ep2-tp2 6 NEREUS_PACK_COMPILE=inline --
i ti_child_tr train-ep2-tp2 6 X=1 -- --trace-c 20
i ti_inline_tr train-ep2-tp2 6 NEREUS_PACK_COMPILE=inline -- --trace-c 20
i gi_child gen-ep2-tp2 24 X=1 --
i gi_inline gen-ep2-tp2 24 NEREUS_PACK_COMPILE=inline --
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env TRITON_CACHE_DIR=/tmp/tc_$name "${envs[@]}" timeout 120 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first" $O/$name.log | sed "s/^/$name /" | cut -c1-330
}
h t6_now 6 5 X=1 -- --moe train-ep2-tp2
h t6_wait 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_now_inline 6 5 NEREUS_PACK_COMPILE=inline -- --moe train-ep2-tp2
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
tar czf $OUT/s14a.tgz -C $O .
cat $O/steps.txt
