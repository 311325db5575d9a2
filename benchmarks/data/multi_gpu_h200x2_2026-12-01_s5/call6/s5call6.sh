#!/usr/bin/env bash
# session 5 call 6 (2 x H200): the stream's chunk size, 128 MiB (default) against 256 and
# 512 MiB: interleaved in one process (variants.py), and per process at 2 and 32 layers
O=/tmp/o; mkdir -p $O
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
MG=benchmarks/multi_gpu
BUDGET=${BUDGET:-260}
t0=$(date +%s)
nvidia-smi -L > $O/machine.txt
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - t0) ))
  [ $left -lt $cap ] && cap=$left
  if [ $cap -lt 25 ]; then echo "$name skipped (budget)" >> $O/steps.txt; return; fi
  timeout $cap "$@" > $O/$name.log 2>&1; echo "$name rc=$? at $(( $(date +%s)-t0 ))s" >> $O/steps.txt
}
C256=$((256 << 20))
step variants 70 $R $MG/variants.py --repeats 11 --variants default,chunk-256m,chunk-512m,chunk-256m-depth4 --json-out $O/variants.json
step L32_c128 45 $R $MG/dtensor_compare.py --layers 32 --repeats 11 --json-out $O/L32_c128.json
step L32_c256 45 env NEREUS_P2P_CHUNK_BYTES=$C256 $R $MG/dtensor_compare.py --layers 32 --repeats 11 --json-out $O/L32_c256.json
step L2_c128 35 $R $MG/dtensor_compare.py --layers 2 --repeats 11 --json-out $O/L2_c128.json
step L2_c256 35 env NEREUS_P2P_CHUNK_BYTES=$C256 $R $MG/dtensor_compare.py --layers 2 --repeats 11 --json-out $O/L2_c256.json
step reshard_c256 70 env NEREUS_P2P_CHUNK_BYTES=$C256 $R $MG/reshard.py --quick --dcp-layers 0 --skip-gather-scatter --modes device --json-out $O/reshard_c256.json
tar czf $OUT/call6.tgz -C $O .
cat $O/steps.txt; cp $O/steps.txt $OUT/
grep -h "^\[" $O/variants.log | grep -v bandwidth | cut -c1-200
for f in $O/L*.log; do echo "== $f"; grep -h "tp-dp:\|dp-tp:\|prepared" $f | cut -c1-160; done
grep -h "nereus warm" $O/reshard_c256.log | cut -c1-200
