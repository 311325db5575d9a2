#!/usr/bin/env bash
# session 11, 1 x H200, call 9: the review fixes (16-byte aligned tables, LRU cache, warm without host pieces)
O=/tmp/o9; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s11i.sh .devrun/gpu_align.py $O/
timeout 60 python3 .devrun/gpu_align.py > $O/gpu_align.log 2>&1; echo "gpu_align rc=$?" >> $O/steps.txt; cat $O/gpu_align.log
timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_replay_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
tar czf $OUT/s11i.tgz -C $O .
cd benchmarks/multi_gpu
timeout 80 python3 host_only.py --layers 32 --repeats 7 --ab-replay --json-out $O/ab32i.json > $O/ab32i.log 2>&1; echo "ab32i rc=$?" >> $O/steps.txt
grep -h "^replay\|^first" $O/ab32i.log
cd ../..
tar czf $OUT/s11i.tgz -C $O .
cat $O/steps.txt
