#!/usr/bin/env bash
# session 12, 1 x H200, call 5: the final tree (review fixes to the prover, the grouped torch path
# for a first execution's chunks): cold / second / warm calls; the CUDA tests; nereus train offload
O=/tmp/o5; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12e.sh $O/
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/multi_gpu
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_prepare.py tests/runtime/test_transition_overhead.py tests/runtime/test_prover.py -k "not byte_exact" > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 150 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$?" >> $O/steps.txt
  grep -h "^plain\|^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s12e.tgz -C $O .
}
for i in 1 2; do
h t6_default$i 6 5 X=1 -- --moe train-ep2-tp2
h t6_inline$i 6 5 NEREUS_PROVER=inline -- --moe train-ep2-tp2
done
h g24_default 24 5 X=1 -- --moe gen-ep2-tp2
h g6_default 6 7 X=1 -- --moe gen-ep2-tp2
h d32_default 32 7 X=1 --
(cd benchmarks/multi_gpu && timeout 120 python3 cold_phases.py $O/pt6_default.json -- --repeats 1 --moe train-ep2-tp2 --layers 6 > $O/pt6_default.log 2>&1); echo "pt6 rc=$?" >> $O/steps.txt
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$?" >> $O/steps.txt
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in c.items() if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -1
echo "prover processes left: $(ps aux | grep -c '[n]ereus.backends.proof')" >> $O/steps.txt
tar czf $OUT/s12e.tgz -C $O .
cat $O/steps.txt
