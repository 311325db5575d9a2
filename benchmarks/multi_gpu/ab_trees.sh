#!/usr/bin/env bash
# 2 GPUs: an older tree (OLD, default .devrun/old) against this one, interleaved, in priority
# order, each step under min(its cap, what is left of BUDGET seconds); results in $OUT/call2.tgz.
#   mkdir -p .devrun/old && git archive c1183ac nereus benchmarks/multi_gpu | tar x -C .devrun/old
#   bash benchmarks/multi_gpu/ab_trees.sh        # on the device, after the wheels (README.md)
# c1183ac is the tree of the last 2-GPU table in benchmarks/RESULTS.md (session 5).
O=/tmp/o; mkdir -p $O/prof
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
NEW=$PWD; OLD=${OLD:-$PWD/.devrun/old}; SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-560}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt; nvidia-smi topo -m >> $O/machine.txt 2>&1
nproc >> $O/machine.txt; lscpu | grep "Model name" >> $O/machine.txt
step() {  # step NAME CAP TREE script args...: under min(CAP, what is left of BUDGET)
  local name=$1 cap=$2 tree=$3; shift 3
  local T=$NEW; [ $tree = old ] && T=$OLD
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  local s=$1; shift
  (cd $T && timeout $cap env PYTHONPATH=$T:$SITE $R $T/benchmarks/multi_gpu/$s "$@" > $O/$name.log 2>&1)
  echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py > $O/unit.log 2>&1; echo "unit rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
step correctness_new 70 new correctness.py --quick --json-out $O/correctness_new.json
step dt8_old 45 old dtensor_compare.py --layers 8 --json-out $O/dt8_old.json
step dt8_new 45 new dtensor_compare.py --layers 8 --json-out $O/dt8_new.json
step variants_new 90 new variants.py --variants default,defer,gc-on --json-out $O/variants_new.json
step reshard_new 90 new reshard.py --quick --json-out $O/reshard_new.json
step ws_old 60 old weight_sync.py --quick --json-out $O/ws_old.json
step ws_new 60 new weight_sync.py --quick --json-out $O/ws_new.json
step dt32_old 60 old dtensor_compare.py --layers 32 --repeats 5 --json-out $O/dt32_old.json
step dt32_new 60 new dtensor_compare.py --layers 32 --repeats 5 --json-out $O/dt32_new.json
step offload_old 60 old offload_check.py --json-out $O/offload_old.json
step offload_new 60 new offload_check.py --json-out $O/offload_new.json
step dt8_new2 45 new dtensor_compare.py --layers 8 --json-out $O/dt8_new2.json
step dt8_old2 45 old dtensor_compare.py --layers 8 --json-out $O/dt8_old2.json
step moe_old 80 old moe_reshard.py --quick --json-out $O/moe_old.json
step moe_new 80 new moe_reshard.py --quick --json-out $O/moe_new.json
export NEREUS_PAUSE_GC=0; step moe_new_gcon 80 new moe_reshard.py --quick --json-out $O/moe_new_gcon.json; unset NEREUS_PAUSE_GC
step host_L8 60 new host_profile.py --layers 8 --repeats 15 --out $O/prof/host_L8.txt --json-out $O/host_L8.json
tar czf ${OUT:-/tmp}/call2.tgz -C $O .
cat $O/steps.txt; tail -3 $O/unit.log
for f in $O/*.log; do echo "== $f"; grep -h "^\[\|ratio\|bound" $f | cut -c1-200 | tail -4; done
