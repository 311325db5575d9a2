#!/usr/bin/env bash
# session 10, 1 x H200, call 3: rank 0's TP -> DP with no peer (fake process group): how much of
# each call the GPU is busy (PyTorch profiler), default and two stream settings, 8 and 32 layers
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [env...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 150 env "$@" python3 host_only.py --layers $layers --repeats $reps --trace $O/$name.trace.json \
    --json-out $O/$name.json > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
}
h d8 8 9 X=1
h d32 32 5 X=1
h alone8 8 9 NEREUS_P2P_ALONE_BYTES=4194304
h alone32 32 5 NEREUS_P2P_ALONE_BYTES=4194304
h c256_8 8 9 NEREUS_P2P_CHUNK_BYTES=268435456
h d8b 8 9 X=1
cd ../..
cp .devrun/s10single3.sh $O/
gzip $O/*.trace.json
tar czf $OUT/single3.tgz -C $O .
cat $O/steps.txt; for f in $O/*.log; do echo "== $f"; grep -h "^plain\|^trace" $f; done
