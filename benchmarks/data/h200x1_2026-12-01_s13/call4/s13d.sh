#!/usr/bin/env bash
# session 13, 1 x H200, call 4: lowering ahead after the review (29e5c83: pairs once, ways back, facts, own
# stream, compile lock). CUDA tests; nereus train 1-GPU offload against its control; host_only
# first calls (thread done, right after, off); what the thread costs a loop beside it
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s13d.sh $O/
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_ahead_cuda.py tests/runtime/test_ahead.py tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_executor_cuda.py tests/runtime/test_replay_cuda.py tests/runtime/test_prepare.py tests/runtime/test_offload_cuda.py > $O/unit.log 2>&1; echo "unit rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
tail -1 $O/unit.log
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
rm -rf $O/train_offload
tail -1 $O/train_offload.log | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); c=d.get('control', d); print({k: v for k, v in (c.items() if isinstance(c, dict) else []) if k.startswith(('same', 'max_abs'))})" 2>&1 | tail -2
ps -eo pid,args | grep -c "nereus.backends.proof" >> $O/steps.txt
tar czf $OUT/s13d.tgz -C $O .
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 120 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
  grep -h "^plain a-b\|^first" $O/$name.log | sed "s/^/$name /" | cut -c1-330
  tar czf $OUT/s13d.tgz -C $O .
}
for i in 1 2; do
h t6_wait$i 6 5 X=1 -- --moe train-ep2-tp2 --wait-ahead
h t6_now$i 6 5 X=1 -- --moe train-ep2-tp2
done
h t6_off 6 5 NEREUS_LOWER_AHEAD=0 -- --moe train-ep2-tp2
h g24_wait 24 5 X=1 -- --moe gen-ep2-tp2 --wait-ahead
h g24_now 24 5 X=1 -- --moe gen-ep2-tp2
h d32_wait 32 7 X=1 -- --wait-ahead
h d32_now 32 7 X=1 --
for c in "train-ep2-tp2 6" "gen-ep2-tp2 24"; do set -- $c
(cd benchmarks/multi_gpu && timeout 150 python3 ahead_interference.py --moe $1 --layers $2 --json-out $O/interf_$1_$2.json > $O/interf_$1_$2.log 2>&1); echo "interf $1 $2 rc=$? $(( $(date +%s) - t0 ))s" >> $O/steps.txt
grep -v "^{" $O/interf_$1_$2.log | tail -3
tar czf $OUT/s13d.tgz -C $O .
done
cat $O/steps.txt
