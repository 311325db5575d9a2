#!/usr/bin/env bash
# session 12, 1 x H200, call 7: the second review's prover fixes on this host: the prover tests, the
# CUDA runtime tests, nereus train offload against its control; one MoE cold call
O=/tmp/o7; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12g.sh $O/
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/multi_gpu
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$?" >> $O/steps.txt
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in c.items() if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -1
(cd benchmarks/multi_gpu && timeout 100 python3 host_only.py --layers 6 --repeats 5 --moe train-ep2-tp2 --json-out $O/t6_default.json > $O/t6_default.log 2>&1); echo "t6 rc=$?" >> $O/steps.txt
grep -h "^plain a-b\|^first" $O/t6_default.log | cut -c1-120
echo "prover processes left: $(ps aux | grep -c '[n]ereus.backends.proof')" >> $O/steps.txt
tar czf $OUT/s12g.tgz -C $O .
cat $O/steps.txt
