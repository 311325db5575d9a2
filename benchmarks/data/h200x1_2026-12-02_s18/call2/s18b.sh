#!/usr/bin/env bash
# session 18, 1 x H200, call 2: why the way back right after the commit still misses.
# host_only first calls (reservation on, the default) recording each fallback's missing
# kernel variants and caller, whether the lowering-ahead thread was busy, the allocator's
# footprint; two runs with the reservation off for the footprint; the way back's first
# and second calls under cProfile
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt; date -u >> $O/machine.txt
cp .devrun/s18b.sh $O/
t0=$(date +%s)
step() { echo "$1 rc=$2 $(( $(date +%s) - t0 ))s" >> $O/steps.txt; tar czf $OUT/s18b.tgz -C $O .; }
h() {  # h NAME LAYERS REPEATS [env...] -- args
  local name=$1 layers=$2 reps=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  (cd benchmarks/multi_gpu && env "${envs[@]}" timeout 60 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1); step $name $?
  grep -h "^first calls:" $O/$name.log | sed "s/^/$name /" | cut -c1-200
}
for k in 1 2 3 4 5 6; do h t6_on_$k 6 5 X=1 -- --moe train-ep2-tp2; done
for k in 1 2; do h t6_off_$k 6 5 NEREUS_RESERVE_ROUNDS=0 -- --moe train-ep2-tp2; done
for k in 1 2 3; do h t6_prof_$k 6 3 X=1 -- --moe train-ep2-tp2 --profile-cold $O/t6_prof_$k.prof --profile-case b-a; done
for k in 1 2; do h g24_on_$k 24 5 X=1 -- --moe gen-ep2-tp2; done
tar czf $OUT/s18b.tgz -C $O .
cat $O/steps.txt
