#!/usr/bin/env bash
# session 22, 1 x H200, call 5 (tree in .devrun/tree.txt): the whole test suite (not vllm) on this
# image after the GPU-host fixes (call 4: 6 failed, 1267 passed).
O=/tmp/o5; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; nproc; python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; } > $O/machine.txt 2>&1
cp .devrun/s22e.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s22e.tgz -C $O .; }
timeout 330 python3 -m pytest -q -p no:cacheprovider -m "not vllm" -n 14 -rf > $O/suite.log 2>&1; step suite $?
tail -12 $O/suite.log | cut -c1-400
tar czf $OUT/s22e.tgz -C $O .
cat $O/steps.txt
