#!/usr/bin/env bash
# session 22, 1 x H200, call 4 (tree in .devrun/tree.txt): --backend auto on a 1-GPU host with
# --nproc 2 (gloo, a note), --backend nccl --nproc 2 (refused before launch), a rank failing
# in set_device (its own error shown); then the whole test suite (not vllm) on this image.
O=/tmp/o4; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; nproc; python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; python3 -c "import xdist; print('xdist', xdist.__version__)"; } > $O/machine.txt 2>&1
cp .devrun/s22d.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s22d.tgz -C $O .; }
NR() { python3 -c 'from nereus.cli import nereus; nereus()' "$@"; }
timeout 120 bash -c "$(declare -f NR); NR train examples/rl/grpo-cpu.nir --algo grpo --nproc 2 --steps 3 --out /tmp/r_auto" > $O/auto2.out 2> $O/auto2.log; step auto2 $?
timeout 60 bash -c "$(declare -f NR); NR train examples/rl/grpo-cpu.nir --algo grpo --nproc 2 --steps 3 --backend nccl --out /tmp/r_nccl2" > $O/nccl2.out 2> $O/nccl2.log; step nccl2_refused $?
timeout 120 python3 - > $O/setdevice.log 2>&1 <<'PY'
import time
from nereus.cli.launch import TrainingFailed, launch
config = {"plan_file": "examples/rl/grpo-cpu.nir", "plan": "S1", "steps": 1, "events": [], "seed": 0,
          "backend": "nccl", "rl": {"algo": "grpo"}, "out": "/tmp/r_setdevice/run"}
t = time.perf_counter()
try:
    launch(config, 2, config["out"], "train", quiet=False, failure_timeout_s=60)
    print("no failure")
except TrainingFailed as e:
    print("seconds", round(time.perf_counter() - t, 2)); print(str(e)[:1500])
PY
step setdevice $?
head -c 3000 $O/auto2.log | head -12; cat $O/nccl2.log; head -12 $O/setdevice.log
timeout 420 python3 -m pytest -q -p no:cacheprovider -m "not vllm" -n 14 -rf > $O/suite.log 2>&1; step suite $?
tail -15 $O/suite.log
tar czf $OUT/s22d.tgz -C $O .
cat $O/steps.txt
