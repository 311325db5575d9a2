#!/usr/bin/env bash
# session 5 call 8 (2 x H200): offloaded units' PCIe copies per piece, no host-side pack;
# A/B against the previous tree (prev = 9395e04, the tree before it), interleaved
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
BUDGET=${BUDGET:-200}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 20 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
NEW=$PWD; PREV=$PWD/.devrun/prev; SITE=/tmp/site
step unit 40 env PYTHONPATH=$NEW:$SITE python3 -m pytest -q -p no:cacheprovider tests/runtime/test_offload_cuda.py
for round in 1 2; do
  for tree in prev new; do
    if [ $tree = prev ]; then T=$PREV; else T=$NEW; fi
    step offload_${tree}_$round 35 env PYTHONPATH=$T:$SITE $R $T/benchmarks/multi_gpu/offload_check.py --json-out $O/offload_${tree}_$round.json
  done
done
step correctness 45 env PYTHONPATH=$NEW:$SITE $R benchmarks/multi_gpu/correctness.py --quick --json-out $O/correctness.json
tar czf $OUT/call8.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
tail -3 $O/unit.log
for f in $O/offload_*.log; do echo "== $f"; grep -h "^\[" $f | grep -v "layers\|check:" | cut -c1-120; done
grep -h "PASSED\|FAILED" $O/correctness.log | tail -2
