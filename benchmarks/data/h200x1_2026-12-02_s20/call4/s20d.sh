#!/usr/bin/env bash
# session 20, 1 x H200, call 4: the lowering-ahead thread on one intra-op thread
# (nereus.runtime.intraop, working tree) against HEAD (fdc873f, trees/head):
# (1) thread_steps.py beside building the state and alone, --intraop one / inherit;
# (2) host_only.py first calls right after construction (default settings), alternating trees
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt; nproc >> $O/machine.txt
cp .devrun/s20d.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20d.tgz -C $O .; }
ROOT=$PWD
r() {  # r NAME ARGS...
  local name=$1; shift
  (cd $ROOT/benchmarks/multi_gpu && timeout 90 python3 thread_steps.py --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^replays:" $O/$name.log | sed "s/^/$name /"
}
r ts_build_one_1 --layers 6 --beside build
r ts_build_inherit_1 --layers 6 --beside build --intraop inherit
r ts_build_one_2 --layers 6 --beside build
r ts_build_inherit_2 --layers 6 --beside build --intraop inherit
r ts_alone_one_1 --layers 6
r ts_alone_inherit_1 --layers 6 --intraop inherit
h() {  # h NAME TREE
  local name=$1 tree=$2
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  (cd $dir/benchmarks/multi_gpu && PYTHONPATH=$dir:/tmp/site timeout 45 python3 host_only.py --layers 6 --repeats 5 --json-out $O/$name.json --moe train-ep2-tp2 > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
for k in 1 2 3 4; do
  if [ $((k % 2)) = 1 ]; then order="head new"; else order="new head"; fi
  for t in $order; do h t6_${t}_$k $t; done
done
tar czf $OUT/s20d.tgz -C $O .
cat $O/steps.txt
