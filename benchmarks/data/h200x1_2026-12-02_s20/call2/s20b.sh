#!/usr/bin/env bash
# session 20, 1 x H200, call 2: the lowering-ahead thread's steps for the 6-layer
# Qwen3-30B-A3B training change, timed step by step (thread_steps.py): alone (with cProfile),
# and beside building and registering the state; the generation change (24 layers) alone
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s20b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20b.tgz -C $O .; }
cd benchmarks/multi_gpu
r() {  # r NAME ARGS...
  local name=$1; shift
  timeout 90 python3 thread_steps.py --json-out $O/$name.json "$@" > $O/$name.log 2>&1; step $name $?
  grep -h "^replays:" $O/$name.log | sed "s/^/$name /"
}
r t6_alone_1 --layers 6 --profile $O/t6_alone_1.prof
r t6_beside_1 --layers 6 --beside build
r t6_alone_2 --layers 6
r t6_beside_2 --layers 6 --beside build
r g24_alone_1 --moe gen-ep2-tp2 --layers 24
tar czf $OUT/s20b.tgz -C $O .
cat $O/steps.txt
