#!/usr/bin/env bash
# session 11, 1 x H200, call 3: every runtime CUDA test file on this tree; host_only A/B after lazy
# receive binding; cold calls with replays on / off; nereus train on one GPU into and out of offload
O=/tmp/o3; rm -rf $O; mkdir -p $O
nvidia-smi -L > $O/machine.txt; cat .devrun/tree.txt >> $O/machine.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_replay_cuda.py tests/runtime/test_mapped_host_cuda.py tests/runtime/test_offload_cuda.py tests/runtime/test_executor_cuda.py tests/runtime/test_room_cuda.py tests/runtime/test_offload.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py tests/runtime/test_exchange_order.py tests/runtime/test_deferred_alloc.py tests/runtime/test_gc_pause.py tests/runtime/test_rank_parts.py tests/runtime/test_prepare.py tests/runtime/test_desync.py tests/runtime/test_transition_overhead.py tests/runtime/test_settings.py tests/runtime/test_register_checks.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tail -2 $O/unit.log
cd benchmarks/multi_gpu
h() {  # h NAME LAYERS REPEATS [args...]
  local name=$1 layers=$2 reps=$3; shift 3
  timeout 170 python3 host_only.py --layers $layers --repeats $reps --json-out $O/$name.json "$@" > $O/$name.log 2>&1; echo "$name rc=$?" >> $O/steps.txt
  grep -h "^replay\|^plain\|^trace\|^cold" $O/$name.log | sed "s/^/$name /"
}
h ab32c 32 9 --ab-replay
h ab8c 8 15 --ab-replay
NEREUS_REPLAY=0 h coldoff32 32 3
NEREUS_REPLAY=1 h coldon32 32 3
cd ../..
T0=$(date +%s)
timeout 200 python3 -c "from nereus.cli import nereus; nereus()" train examples/rl/ppo-1gpu-offload.nir --nproc 1 --backend nccl --steps 6 --events "2:S2,4:S1" --control --out $O/train_offload --json > $O/train_offload.log 2>&1; echo "train offload rc=$? $(( $(date +%s) - T0 )) s" >> $O/steps.txt
rm -rf $O/train_offload
cp .devrun/s11c.sh $O/
tar czf $OUT/s11c.tgz -C $O .
cat $O/steps.txt; tail -c 600 $O/train_offload.log
