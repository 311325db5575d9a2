#!/usr/bin/env bash
# session 20, 1 x H200, call 3: thread_steps.py with the thread's getrusage per step: alone,
# beside building the state, beside only allocating it; building with OMP_NUM_THREADS=1 and
# with expandable segments (hypotheses: intra-op threads, the allocator's mappings)
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt; nproc >> $O/machine.txt
cp .devrun/s20c.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20c.tgz -C $O .; }
cd benchmarks/multi_gpu
r() {  # r NAME ARGS...
  local name=$1; shift
  timeout 90 python3 thread_steps.py --json-out $O/$name.json "$@" > $O/$name.log 2>&1; step $name $?
  grep -h "^replays:" $O/$name.log | sed "s/^/$name /"
}
r t6_alone_1 --layers 6
r t6_build_1 --layers 6 --beside build
r t6_alloc_1 --layers 6 --beside alloc
r t6_build_2 --layers 6 --beside build
r t6_alloc_2 --layers 6 --beside alloc
OMP_NUM_THREADS=1 r t6_build_omp1 --layers 6 --beside build
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True r t6_build_expandable --layers 6 --beside build
tar czf $OUT/s20c.tgz -C $O .
cat $O/steps.txt
