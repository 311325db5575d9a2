#!/usr/bin/env bash
# session 17, 1 x H200, call 2: where a right-after first call's time goes (host_only's cold
# details: compile, rounds' host/device split; cProfile of the first call), and which C calls
# of the thread hold the GIL beside a launch-bound loop (ahead_interference --trace-c)
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s17b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s17b.tgz -C $O .; }
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-330
}
for k in 1 2 3 4; do h t6_now_$k 6 5 X=1 -- --moe train-ep2-tp2; done
h t6_prof_1 6 5 X=1 -- --moe train-ep2-tp2 --profile-cold $O/t6_prof_1.prof --top 60
h t6_prof_2 6 5 X=1 -- --moe train-ep2-tp2 --profile-cold $O/t6_prof_2.prof --top 60
h t6_fresh_prof 6 5 TRITON_CACHE_DIR=/tmp/tc_c -- --moe train-ep2-tp2 --profile-cold $O/t6_fresh_prof.prof --top 60
h t6_fresh_2 6 5 TRITON_CACHE_DIR=/tmp/tc_d -- --moe train-ep2-tp2
i() {  # i NAME CASE LAYERS args
  local n=$1 c=$2 l=$3; shift 3
  (cd benchmarks/multi_gpu && timeout 60 python3 ahead_interference.py --moe $c --layers $l --json-out $O/$n.json "$@" > $O/$n.log 2>&1); step $n $?
  grep -v "^{" $O/$n.log | tail -4 | cut -c1-240 | sed "s/^/$n /"
}
i ti_c1 train-ep2-tp2 6 --trace-c 20
i ti_c2 train-ep2-tp2 6 --trace-c 20
tar czf $OUT/s17b.tgz -C $O .
cat $O/steps.txt
