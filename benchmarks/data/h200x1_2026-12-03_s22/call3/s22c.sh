#!/usr/bin/env bash
# session 22, 1 x H200, call 3 (tree in .devrun/tree.txt): the transformers-facing tests under this
# image's transformers/safetensors; bf16 checkpoints written by transformers, logits on CUDA, GRPO on 1 GPU.
O=/tmp/o3; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; nproc; python3 -c "import torch, triton, sys, transformers, safetensors; print(sys.version.split()[0], torch.__version__, triton.__version__, 'transformers', transformers.__version__, 'safetensors', safetensors.__version__)"; } > $O/machine.txt 2>&1
cp .devrun/s22c.sh .devrun/gpu_hf.py $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s22c.tgz -C $O .; }
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/models tests/runtime/test_hf_checkpoint.py \
  tests/runtime/test_hf_checkpoint_local.py tests/rl/test_hf_train.py > $O/unit.log 2>&1; step unit $?
tail -3 $O/unit.log
timeout 250 python3 .devrun/gpu_hf.py > $O/gpu_hf.log 2>&1; step gpu_hf $?
tail -1 $O/gpu_hf.log > $O/gpu_hf.json
grep -v "^{" $O/gpu_hf.log | cut -c1-400
tar czf $OUT/s22c.tgz -C $O .
cat $O/steps.txt
