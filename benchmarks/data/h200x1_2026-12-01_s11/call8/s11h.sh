#!/usr/bin/env bash
# session 11, 1 x H200, call 8: rank 0's MoE EP -> TP / DP with no peer (host_only.py --moe), replays off / on
# alternating in one process (Qwen3-30B-A3B shapes)
O=/tmp/o8; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s11h.sh $O/
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [args...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 110 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^replay\|^plain\|^trace\|^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s11h.tgz -C $O .  # what has run so far comes back even if the call is cut
}
h gen6 6 7 --moe gen-ep2-tp2 --ab-replay
h train6 6 5 --moe train-ep2-tp2 --ab-replay
h gen24 24 5 --moe gen-ep2-tp2 --ab-replay
cd ../..
cat $O/steps.txt
