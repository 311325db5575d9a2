#!/usr/bin/env bash
# session 22, 1 x H200, call 1 (tree in .devrun/tree.txt): session 21's changes on a GPU host
# (rank rendezvous in the CUDA tests' single_process_control, the c10d launcher of nereus train
# under torch 2.11, the per-step intra-op test of e3380c9), nereus train on NCCL with 1 process,
# a fault on NCCL (1 process) and on gloo (2 processes), run_all.sh's failure step with gloo.
O=/tmp/o1; rm -rf $O; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > $O/pip.log 2>&1
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; cat .devrun/tree.txt; date -u; nproc; python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)"; python3 -c "import pytest, hypothesis; print('pytest', pytest.__version__, 'hypothesis', hypothesis.__version__)"; } > $O/machine.txt 2>&1
cp .devrun/s22a.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s22a.tgz -C $O .; }
timeout 280 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_intraop.py tests/runtime/test_ahead.py \
  tests/runtime/test_ahead_cuda.py tests/runtime/test_allocator_cuda.py tests/runtime/test_executor_cuda.py \
  tests/runtime/test_replay_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_mapped_host_cuda.py \
  tests/runtime/test_room_cuda.py tests/backends/test_pack_upload.py tests/runtime/test_prepare.py \
  tests/rl/test_launch.py > $O/unit.log 2>&1; step unit $?
tail -3 $O/unit.log
NR="python3 -c 'from nereus.cli import nereus; nereus()'"
tr() { local name=$1 cap=$2; shift 2; local a=$(date +%s.%N)
  timeout -k 10 $cap python3 -c 'from nereus.cli import nereus; nereus()' train "$@" --json --out /tmp/r_$name > $O/$name.out 2> $O/$name.log
  local rc=$?; local b=$(date +%s.%N); echo "$name rc=$rc wall=$(python3 -c "print(round($b-$a,2))")s" >> $O/steps.txt; tar czf $OUT/s22a.tgz -C $O .; }
tr ppo1_nccl 150 examples/rl/ppo-1gpu.nir --nproc 1 --backend nccl --steps 4
NEREUS_STEP_FAULT=0:2 tr ppo1_nccl_fault 120 examples/rl/ppo-1gpu.nir --nproc 1 --backend nccl --steps 5
NEREUS_STEP_FAULT=1:2 tr grpo2_gloo_fault 120 examples/rl/grpo-cpu.nir --algo grpo --nproc 2 --backend gloo --steps 6
OUT=$O bash benchmarks/multi_gpu/run_all.sh --cpu 2 --only failure > $O/runall_failure.log 2>&1; step runall_failure_gloo $?
tar czf $OUT/s22a.tgz -C $O .
cat $O/steps.txt
