#!/usr/bin/env bash
# session 12, 1 x H200, call 2: wall-clock phases of MoE cold calls (coldprobe.py), default /
# torch pack path / replays off; the host's pure-Python phases (phases.py) for calibration
O=/tmp/o2; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cp .devrun/s12b.sh .devrun/coldprobe.py .devrun/phases.py $O/
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/multi_gpu
python3 .devrun/phases.py train-ep2-tp2 6 > $O/phases_t6.txt 2>&1; cat $O/phases_t6.txt
p() {  # p NAME [env...] -- args
  local name=$1; shift
  env "$@" timeout 120 python3 .devrun/coldprobe.py $O/$name.json -- --repeats 1 $ARGS > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^first" $O/$name.log | sed "s/^/$name /"
  tar czf $OUT/s12b.tgz -C $O .
}
ARGS="--moe train-ep2-tp2 --layers 6"
p t6_default X=1
p t6_torch NEREUS_PACK_BACKEND=torch
p t6_noreplay NEREUS_REPLAY=0
p t6_default2 X=1
ARGS="--moe gen-ep2-tp2 --layers 24"
p g24_default X=1
p g24_torch NEREUS_PACK_BACKEND=torch
ARGS="--layers 32"
p d32_default X=1
cat $O/steps.txt
