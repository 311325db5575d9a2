#!/usr/bin/env bash
# session 12, 1 x H200, call 3: cold and second calls after the prover process, the prepared-JIT
# table fix and the pieces' geometry memo: host_only.py (defaults; NEREUS_PROVER=inline; no proof
# ahead), coldprobe phases; the CUDA runtime tests and the prover tests on this host
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12c.sh $O/
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/multi_gpu
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_prover.py -k "not byte_exact" tests/runtime/test_replay_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_prepare.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 150 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); echo "$name rc=$?" >> $O/steps.txt
  grep -h "^plain\|^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s12c.tgz -C $O .
}
p() {  # p NAME [env...] -- args
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 120 python3 .devrun/coldprobe.py $O/$name.json -- --repeats 1 "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s12c.tgz -C $O .
}
for i in 1 2; do
h t6_default$i 6 5 X=1 -- --moe train-ep2-tp2
h t6_inline$i 6 5 NEREUS_PROVER=inline -- --moe train-ep2-tp2
h t6_noahead$i 6 5 NEREUS_PROVE_AHEAD=0 -- --moe train-ep2-tp2
done
h g24_default 24 5 X=1 -- --moe gen-ep2-tp2
h g24_inline 24 5 NEREUS_PROVER=inline -- --moe gen-ep2-tp2
h g6_default 6 7 X=1 -- --moe gen-ep2-tp2
h g6_inline 6 7 NEREUS_PROVER=inline -- --moe gen-ep2-tp2
h d32_default 32 7 X=1 --
h d32_inline 32 7 NEREUS_PROVER=inline --
p pt6_default X=1 -- --moe train-ep2-tp2 --layers 6
p pt6_noahead NEREUS_PROVE_AHEAD=0 -- --moe train-ep2-tp2 --layers 6
cat $O/steps.txt
