#!/usr/bin/env bash
# session 22, 1 x H200, call 6 (tree: HEAD + the working tree's test_offload changes): the tests
# call 5 failed or the fixes touched, within the little device time left.
O=/tmp/o6; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; } > $O/machine.txt 2>&1
cp .devrun/s22f.sh $O/
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 14 -rf tests/runtime/test_offload_cuda.py tests/runtime/test_offload.py \
  tests/rl/test_bf16_transitions.py tests/rl/test_layout_units.py tests/ir/test_ir_fmt_cli.py tests/rl/test_failures.py \
  tests/passes/test_verify_mutations.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -4 $O/unit.log | cut -c1-300
tar czf $OUT/s22f.tgz -C $O .
