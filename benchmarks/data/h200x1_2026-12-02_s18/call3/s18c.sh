#!/usr/bin/env bash
# session 18, 1 x H200, call 3: compiling a call's missing kernel variants in the call
# (NEREUS_INLINE_COMPILE_S, default 0.1 s) against never (0), alternating; the compile
# times; CUDA tests of the packer, replays, ahead thread, prepare, allocator; empty Triton
# cache; 1-GPU offload train against its control
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s18c.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s18c.tgz -C $O .; }
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_inline_compile_cuda.py tests/runtime/test_allocator_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_mapped_host_cuda.py > $O/unit.log 2>&1; step unit $?
tail -3 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
h t6_fresh_on 6 5 TRITON_CACHE_DIR=/tmp/tc_a -- --moe train-ep2-tp2
h t6_fresh_off 6 5 NEREUS_INLINE_COMPILE_S=0 TRITON_CACHE_DIR=/tmp/tc_b -- --moe train-ep2-tp2
for k in 1 2 3 4 5 6; do
  h t6_on_$k 6 5 X=1 -- --moe train-ep2-tp2
  h t6_off_$k 6 5 NEREUS_INLINE_COMPILE_S=0 -- --moe train-ep2-tp2
done
for k in 1 2 3; do
  h g24_on_$k 24 5 X=1 -- --moe gen-ep2-tp2
  h g24_off_$k 24 5 NEREUS_INLINE_COMPILE_S=0 -- --moe gen-ep2-tp2
done
timeout 90 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
tar czf $OUT/s18c.tgz -C $O .
cat $O/steps.txt
