#!/usr/bin/env bash
# session 15, 1 x H200, call 4: the thread compiles the stream variants before building the
# replays. CUDA tests; host_only first calls right after construction; nereus train control;
# the loop beside the thread
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s15d.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s15d.tgz -C $O .; }
timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_prepare.py tests/runtime/test_replay_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^plain a-b\|^first calls" $O/$name.log | sed "s/^/$name /" | cut -c1-330
}
h t6_now_proc1 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_proc2 6 5 X=1 -- --moe train-ep2-tp2
h t6_now_proc3 6 5 X=1 -- --moe train-ep2-tp2
h g24_now_proc1 24 5 X=1 -- --moe gen-ep2-tp2
h t6_now_proc_fresh 6 5 TRITON_CACHE_DIR=/tmp/tc_d -- --moe train-ep2-tp2
timeout 90 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; step train_offload $?
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
(cd benchmarks/multi_gpu && timeout 40 python3 ahead_interference.py --moe train-ep2-tp2 --layers 6 --json-out $O/ti_1.json > $O/ti_1.log 2>&1); step ti_1 $?
grep -v "^{" $O/ti_1.log | tail -3 | cut -c1-200
tar czf $OUT/s15d.tgz -C $O .
cat $O/steps.txt
