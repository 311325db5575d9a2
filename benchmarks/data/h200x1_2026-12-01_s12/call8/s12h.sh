#!/usr/bin/env bash
# session 12, 1 x H200, call 8: the last-look refactor (no behaviour change) on this host: prover and CUDA tests
O=/tmp/o8; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12h.sh $O/
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
(cd benchmarks/multi_gpu && PYTHONPATH=$PYTHONPATH:$PWD timeout 100 python3 cold_phases.py $O/pt6.json -- --repeats 3 --moe train-ep2-tp2 --layers 6 > $O/pt6.log 2>&1); echo "pt6 rc=$?" >> $O/steps.txt
grep -h "^first\|^plain a-b" $O/pt6.log | cut -c1-110
tar czf $OUT/s12h.tgz -C $O .
cat $O/steps.txt
