#!/usr/bin/env bash
# session 12, 1 x H200, call 6: is a warm MoE call slower with the prover process? default,
# default with the prover closed before the timed calls, inline, default with glibc's mmap
# threshold fixed; interleaved, two rounds (host_only.py --moe train-ep2-tp2 --layers 6)
O=/tmp/o6; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12f.sh .devrun/warm_ab.py $O/
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/multi_gpu
h() {  # h NAME [env...] --
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 100 python3 .devrun/warm_ab.py --layers 6 --repeats 7 --moe train-ep2-tp2 --json-out $O/$name.json > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^plain a-b\|^first" $O/$name.log | cut -c1-120 | sed "s/^/$name /"
  tar czf $OUT/s12f.tgz -C $O .
}
for i in 1 2; do
h default$i X=1 --
h closed$i PROBE_CLOSE=1 --
h inline$i NEREUS_PROVER=inline --
h mmap$i MALLOC_MMAP_THRESHOLD_=33554432 --
done
cat $O/steps.txt
