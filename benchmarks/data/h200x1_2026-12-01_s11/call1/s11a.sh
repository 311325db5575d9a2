#!/usr/bin/env bash
# session 11, 1 x H200, call 1: replayed launches. CUDA tests (the replay's own and every runtime
# CUDA test file), then rank 0's TP -> DP with no peer (host_only.py), replays on / off interleaved
O=/tmp/o1; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_replay_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -3 $O/unit.log
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [env...] -- extra args
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 150 env "$@" python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^plain" $O/$name.log | sed "s/^/$name /"
}
h on8a 8 15 NEREUS_REPLAY=1
h off8a 8 15 NEREUS_REPLAY=0
h on32a 32 7 NEREUS_REPLAY=1
h off32a 32 7 NEREUS_REPLAY=0
h on8b 8 15 NEREUS_REPLAY=1
h off8b 8 15 NEREUS_REPLAY=0
h on32b 32 7 NEREUS_REPLAY=1
h off32b 32 7 NEREUS_REPLAY=0
timeout 150 env NEREUS_REPLAY=1 python3 host_only.py --layers 32 --repeats 5 --trace $O/tron32.trace.json --json-out $O/tron32.json > $O/tron32.log 2>&1; echo "tron32 rc=$?" >> $O/steps.txt
timeout 150 env NEREUS_REPLAY=0 python3 host_only.py --layers 32 --repeats 5 --trace $O/troff32.trace.json --json-out $O/troff32.json > $O/troff32.log 2>&1; echo "troff32 rc=$?" >> $O/steps.txt
timeout 150 env NEREUS_REPLAY=1 python3 host_only.py --layers 32 --repeats 5 --profile $O/profon32.txt --json-out $O/profon32.json > $O/profon32.log 2>&1; echo "profon32 rc=$?" >> $O/steps.txt
cd ../..
cp .devrun/s11a.sh $O/
gzip $O/*.trace.json
tar czf $OUT/s11a.tgz -C $O .
cat $O/steps.txt; grep -h "^trace" $O/tr*.log
