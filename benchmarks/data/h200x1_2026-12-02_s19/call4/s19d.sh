#!/usr/bin/env bash
# session 19, 1 x H200, call 4: the lowering-ahead CUDA tests on the final runtime tree
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s19d.sh $O/
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_prepare.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -3 $O/unit.log
tar czf $OUT/s19d.tgz -C $O .
