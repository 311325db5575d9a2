#!/usr/bin/env bash
# session 12, 1 x H200, call 1: where a MoE transition's first and second calls spend their time
# (host_only.py --moe --profile-cold: cProfile of the first and the second A -> B)
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12a.sh $O/
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [args...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 150 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^replay\|^plain\|^trace\|^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s12a.tgz -C $O .
}
h train6 6 3 --moe train-ep2-tp2 --profile-cold $O/prof_train6.txt --top 60
h gen24 24 3 --moe gen-ep2-tp2 --profile-cold $O/prof_gen24.txt --top 60
h gen6 6 3 --moe gen-ep2-tp2 --profile-cold $O/prof_gen6.txt --top 60
h tpdp32 32 3 --profile-cold $O/prof_tpdp32.txt --top 60
cd ../..
cat $O/steps.txt
