#!/usr/bin/env bash
# session 17, 1 x H200, call 4: call 3 aborted in test_ahead_cuda (a Triton compile after the
# replays, tiny shapes): reproduce with faulthandler; then take() finishing a half-built pair's
# replays in the caller (BUILDING): host_only right after construction; the other CUDA tests;
# nereus train 1-GPU offload against its control
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s17d.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s17d.tgz -C $O .; }
(cd benchmarks/multi_gpu && timeout 60 python3 -X faulthandler host_only.py --shape tiny --layers 2 --moe train-ep2-tp2 --repeats 1 --wait-ahead > $O/tiny.log 2>&1); step tiny $?
tail -5 $O/tiny.log | cut -c1-300
timeout 90 python3 -X faulthandler -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py > $O/unit_ahead.log 2>&1; step unit_ahead $?
tail -3 $O/unit_ahead.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 50 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-330
}
for k in 1 2 3 4; do h t6_now_$k 6 5 X=1 -- --moe train-ep2-tp2; done
h t6_fresh_1 6 5 TRITON_CACHE_DIR=/tmp/tc_a -- --moe train-ep2-tp2
for k in 1 2; do h g24_now_$k 24 5 X=1 -- --moe gen-ep2-tp2; done
timeout 110 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_prepare.py tests/triton/test_replay_cache.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
timeout 70 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
tar czf $OUT/s17d.tgz -C $O .
cat $O/steps.txt
