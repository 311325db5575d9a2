#!/usr/bin/env bash
# session 22, 1 x H200, call 2 (tree in .devrun/tree.txt): after ahead.py's split and the tests'
# PYTHONPATH fix: the lowering-ahead, lowerer, intra-op, launch and CUDA ahead tests; thread_steps
# (its import moved); host_only first calls right after construction (as sessions 15-20).
O=/tmp/o2; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; nproc; python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > $O/machine.txt 2>&1
cp .devrun/s22b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s22b.tgz -C $O .; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead.py tests/runtime/test_ahead_cuda.py \
  tests/runtime/test_lowerer.py tests/runtime/test_intraop.py tests/rl/test_launch.py tests/runtime/test_executor_cuda.py > $O/unit.log 2>&1; step unit $?
tail -2 $O/unit.log
cd benchmarks/multi_gpu
timeout 45 python3 thread_steps.py --layers 6 --beside build --json-out $O/ts_build.json > $O/ts_build.log 2>&1; step ts_build $?
grep -h "^replays:" $O/ts_build.log
for k in 1 2 3; do
  timeout 60 python3 host_only.py --layers 6 --repeats 5 --json-out $O/t6_$k.json --moe train-ep2-tp2 > $O/t6_$k.log 2>&1; step t6_$k $?
  grep -h "^first calls:" $O/t6_$k.log | cut -c1-220
done
timeout 60 python3 host_only.py --layers 24 --repeats 5 --json-out $O/g24.json --moe gen-ep2-tp2 > $O/g24.log 2>&1; step g24 $?
grep -h "^first calls:" $O/g24.log | cut -c1-220
tar czf $OUT/s22b.tgz -C $O .
cat $O/steps.txt
