#!/usr/bin/env bash
# session 18, 1 x H200, call 4: the final tree (round reservation on; compiling in the
# call removed): CUDA tests; host_only first calls right after construction (default
# settings), with the thread done first, and with an empty Triton cache
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s18d.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s18d.tgz -C $O .; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_allocator_cuda.py tests/runtime/test_ahead_cuda.py tests/runtime/test_lowerer.py tests/runtime/test_ahead.py tests/runtime/test_prepare.py tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_room_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
for k in 1 2 3 4 5; do h t6_now_$k 6 5 X=1 -- --moe train-ep2-tp2; done
h t6_wait_1 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_fresh_1 6 5 TRITON_CACHE_DIR=/tmp/tc_a -- --moe train-ep2-tp2
for k in 1 2; do h g24_now_$k 24 5 X=1 -- --moe gen-ep2-tp2; done
tar czf $OUT/s18d.tgz -C $O .
cat $O/steps.txt
