#!/usr/bin/env bash
# session 11, 1 x H200, call 2: replay CUDA tests; rank 0's TP -> DP with no peer (host_only.py),
# every variant compiled first, replays off / on alternating call by call in one process
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_replay_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_prepare.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -2 $O/unit.log
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [args...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 170 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^replay\|^plain\|^trace" $O/$name.log | sed "s/^/$name /"
}
h ab8a 8 15 --ab-replay
h ab32a 32 9 --ab-replay
h ab8b 8 15 --ab-replay
h ab32b 32 9 --ab-replay
NEREUS_REPLAY=1 h tron32 32 5 --trace $O/tron32.trace.json
NEREUS_REPLAY=0 h troff32 32 5 --trace $O/troff32.trace.json
NEREUS_REPLAY=1 h tron8 8 9 --trace $O/tron8.trace.json
NEREUS_REPLAY=0 h troff8 8 9 --trace $O/troff8.trace.json
NEREUS_REPLAY=1 h profon32 32 5 --profile $O/profon32.txt
cd ../..
cp .devrun/s11b.sh $O/
gzip $O/*.trace.json
tar czf $OUT/s11b.tgz -C $O .
cat $O/steps.txt
