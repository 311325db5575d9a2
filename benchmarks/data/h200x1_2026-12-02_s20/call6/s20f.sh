#!/usr/bin/env bash
# session 20, 1 x H200, call 6: more first calls right after construction, HEAD (69c50fa:
# 0e22fb1's runtime) against fdc873f (trees/head), alternating: one pair with an empty Triton
# cache (each its own new directory), a warm-up run (not counted), three pairs with a warm cache
O=/tmp/o6; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt; nproc >> $O/machine.txt
cp .devrun/s20f.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20f.tgz -C $O .; }
ROOT=$PWD
h() {  # h NAME TREE [CACHE]
  local name=$1 tree=$2 cache=${3:-}
  local dir=$ROOT; [ "$tree" != new ] && dir=$ROOT/.devrun/trees/$tree
  [ -n "$cache" ] && export TRITON_CACHE_DIR=$cache || unset TRITON_CACHE_DIR
  (cd $dir/benchmarks/multi_gpu && PYTHONPATH=$dir:/tmp/site timeout 45 python3 host_only.py --layers 6 --repeats 5 --json-out $O/$name.json --moe train-ep2-tp2 > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
h t6_empty_head_3 head /tmp/tc_e_head_3
h t6_empty_new_3 new /tmp/tc_e_new_3
h t6_warmup new
for k in 5 6 7; do
  if [ $((k % 2)) = 1 ]; then order="head new"; else order="new head"; fi
  for t in $order; do h t6_${t}_$k $t; done
done
tar czf $OUT/s20f.tgz -C $O .
cat $O/steps.txt
