#!/usr/bin/env bash
# session 11, 1 x H200, call 4: first and second calls with the compiles after the transition;
# replays on / off; the A/B once more at 32 layers
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_replay_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_prepare.py tests/runtime/test_transition_overhead.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -1 $O/unit.log
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [args...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 170 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^replay\|^plain\|^trace\|^first" $O/$name.log | sed "s/^/$name /"
}
NEREUS_REPLAY=1 h coldon32a 32 3
NEREUS_REPLAY=0 h coldoff32a 32 3
NEREUS_REPLAY=1 h coldon32b 32 3
NEREUS_REPLAY=0 h coldoff32b 32 3
NEREUS_REPLAY=1 h coldon8 8 3
NEREUS_REPLAY=0 h coldoff8 8 3
h ab32d 32 9 --ab-replay
cd ../..
cp .devrun/s11d.sh $O/
tar czf $OUT/s11d.tgz -C $O .
cat $O/steps.txt
