#!/usr/bin/env bash
# session 10, 1 x H200, call 4: two variants (NEREUS_FUSED_COPIES, NEREUS_P2P_FUSED_ALL) against the
# default on rank 0's TP <-> DP with no peer, interleaved; their correctness (CUDA tests, one-rank chains)
O=/tmp/o4; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
V="NEREUS_FUSED_COPIES=1 NEREUS_P2P_FUSED_ALL=1 NEREUS_PACK_JIT=1"
(timeout 200 env $V python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_executor_cuda.py tests/runtime/test_copy_pairs.py tests/runtime/test_offload_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_room_cuda.py > $O/unit_variants.log 2>&1; echo "unit_variants rc=$?" >> $O/steps.txt)
(timeout 100 env $V python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/multi_gpu/correctness.py --quick --json-out $O/corr1.json > $O/corr1.log 2>&1; echo "corr1 variants rc=$?" >> $O/steps.txt)
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [env...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 120 env "$@" python3 host_only.py --layers $layers --repeats $reps --trace $O/$name.trace.json \
    --json-out $O/$name.json > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
}
for i in 1 2; do
h def8_$i 8 9 NEREUS_PACK_JIT=1
h cop8_$i 8 9 NEREUS_FUSED_COPIES=1 NEREUS_PACK_JIT=1
h all8_$i 8 9 NEREUS_P2P_FUSED_ALL=1 NEREUS_PACK_JIT=1
h both8_$i 8 9 NEREUS_FUSED_COPIES=1 NEREUS_P2P_FUSED_ALL=1 NEREUS_PACK_JIT=1
done
h def32 32 5 NEREUS_PACK_JIT=1
h both32 32 5 NEREUS_FUSED_COPIES=1 NEREUS_P2P_FUSED_ALL=1 NEREUS_PACK_JIT=1
h cop32 32 5 NEREUS_FUSED_COPIES=1 NEREUS_PACK_JIT=1
cd ../..
cp .devrun/s10single4.sh $O/
rm -f $O/*.trace.json
tar czf $OUT/single4.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit_variants.log; tail -c 300 $O/corr1.log; echo
for f in $O/*.log; do case $f in *unit*|*corr*) continue;; esac; echo "== $(basename $f)"; grep -h "^plain tp\|^plain dp\|^trace" $f | cut -c1-150; done
