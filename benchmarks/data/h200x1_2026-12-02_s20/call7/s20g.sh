#!/usr/bin/env bash
# session 20, 1 x H200, call 7: HEAD (5a31897's intraop review fixes + thread_steps.py fixes):
# the intra-op and lowering-ahead tests (CPU and CUDA) on the GPU host's torch; thread_steps
# beside building (is the thread's team still one after its steps?); host_only first calls
O=/tmp/o7; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt; nproc >> $O/machine.txt
cp .devrun/s20g.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s20g.tgz -C $O .; }
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_intraop.py tests/runtime/test_ahead.py tests/runtime/test_ahead_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
cd benchmarks/multi_gpu
timeout 45 python3 thread_steps.py --layers 6 --beside build --json-out $O/ts_build_one_3.json > $O/ts_build_one_3.log 2>&1; step ts_build_one_3 $?
grep -h "^replays:" $O/ts_build_one_3.log; grep -o '"intraop_threads": \[[0-9, ]*\]' $O/ts_build_one_3.log
timeout 45 python3 host_only.py --layers 6 --repeats 5 --json-out $O/t6_new_8.json --moe train-ep2-tp2 > $O/t6_new_8.log 2>&1; step t6_new_8 $?
grep -h "^first calls:" $O/t6_new_8.log | cut -c1-200
tar czf $OUT/s20g.tgz -C $O .
cat $O/steps.txt
