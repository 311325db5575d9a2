#!/usr/bin/env bash
# session 12, 1 x H200, call 4: every runtime test file that runs on CUDA, with the prover process
# on by default; nereus train on one GPU into and out of offload against its control run
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12d.sh $O/
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_prepare.py tests/runtime/test_transition_overhead.py tests/runtime/test_prover.py -k "not byte_exact" > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -3 $O/unit.log
T0=$(date +%s)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(( $(date +%s) - T0 )) s" >> $O/steps.txt
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
ps aux | grep -c "[n]ereus.backends.proof" >> $O/steps.txt
tar czf $OUT/s12d.tgz -C $O .
cat $O/steps.txt
