#!/usr/bin/env bash
# Issue 10 in one call: correctness, resharding and weight-sync benchmarks on every GPU of
# this host (torchrun, one process per GPU, NCCL), inside one time budget.
#
#   bash benchmarks/multi_gpu/run_all.sh            # GPU host: counts GPUs with nvidia-smi -L
#   bash benchmarks/multi_gpu/run_all.sh --quick    # smaller cases (8B shapes, 8 layers)
#   bash benchmarks/multi_gpu/run_all.sh --cpu 4    # CPU check: 4 gloo ranks, tiny models
#   bash benchmarks/multi_gpu/run_all.sh --only reshard,weight_sync   # some steps (names below)
#   bash benchmarks/multi_gpu/run_all.sh --only offload,moe,variants  # the steps not run by default
#
# Logs and JSON go to $OUT/multi_gpu (./out/multi_gpu when OUT is unset); the last lines
# printed are a summary table and one JSON object. BUDGET_S (default 560) caps the whole
# run; each step gets what is left (capped per step), a step that cannot get 30 s is
# skipped and listed as such. NCCL_NVLS_ENABLE is left as the machine sets it.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR="${OUT:-./out}/multi_gpu"
mkdir -p "$OUT_DIR"
BUDGET_S="${BUDGET_S:-560}"
PY="${PYTHON:-python3}"
START=$(date +%s)
QUICK=""
CPU_RANKS=""
ONLY=""
KNOWN="correctness reshard weight_sync dtensor failure"
EXTRA_STEPS="offload moe variants"  # run only when named in --only (a default run fills its budget without them)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK="--quick" ;;
    --cpu) CPU_RANKS="$2"; shift ;;
    --only) ONLY=",$2,"; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
               echo "steps (--only): ${KNOWN// /,}; not run by default: ${EXTRA_STEPS// /,}"; exit 0 ;;
    *) echo "unknown option $1 (use --quick, --cpu N, --only STEP,...)"; exit 2 ;;
  esac
  shift
done
for step in ${ONLY//,/ }; do
  case " $KNOWN $EXTRA_STEPS " in
    *" $step "*) ;;
    *) echo "unknown step $step (steps: ${KNOWN// /,}; not run by default: ${EXTRA_STEPS// /,})"; exit 2 ;;
  esac
done
wanted() { [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]; }
named() { [[ "$ONLY" == *",$1,"* ]]; }
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "$CPU_RANKS" ]; then
  N="$CPU_RANKS"
  EXTRA="--backend gloo --device cpu --quick"
  QUICK="--quick"
else
  N=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  EXTRA=""
  if [ "$N" -lt 2 ]; then
    echo "found $N GPU(s): these scripts need at least 2 (use --cpu N to check them on CPU)"
    exit 2
  fi
fi

STEPS="$OUT_DIR/steps.txt"
: > "$STEPS"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "ranks: $N  quick: ${QUICK:-no}  budget: ${BUDGET_S}s  NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-<unset>}"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [ -z "$CPU_RANKS" ]; then nvidia-smi -L; nvidia-smi topo -m; fi
  df -h "${NEREUS_CKPT_DIR:-/tmp}" | tail -1
} > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

# run_step NAME RANKS CAP_S SCRIPT ARGS...: torchrun SCRIPT on RANKS processes, logs and
# JSON under $OUT_DIR, killed after min(CAP_S, budget left - 10) seconds.
run_step() {
  local name="$1" ranks="$2" cap="$3" script="$4"
  shift 4
  local left=$(( BUDGET_S - ($(date +%s) - START) - 10 ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 30 ]; then
    echo "$name skipped (budget: ${left}s left)" | tee -a "$STEPS"
    return
  fi
  echo ">>> $name: $ranks ranks, limit ${limit}s ($(( $(date +%s) - START ))s elapsed)"
  local t0=$(date +%s)
  timeout -k 10 "$limit" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    "benchmarks/multi_gpu/$script" $EXTRA $QUICK --json-out "$OUT_DIR/$name.json" "$@" \
    > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  local status="rc=$rc"
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="timeout after ${limit}s (rc=$rc)"
  echo "$name $status, $(( $(date +%s) - t0 ))s" | tee -a "$STEPS"
  grep -E '^\[ *[0-9.]+s\]' "$OUT_DIR/$name.log" | tail -n 12
  if [ "$rc" -ne 0 ]; then tail -n 15 "$OUT_DIR/$name.log"; fi
}

# failure_step NAME RANKS CAP_S: `nereus train` with rank 1 raising after step 2
# (NEREUS_STEP_FAULT); records how long the job took to end and the error it showed.
failure_step() {
  local name="$1" ranks="$2" cap="$3" backend="nccl"
  [ -n "$CPU_RANKS" ] && backend="gloo"
  # an earlier run's error reports would time this job's end from their failure
  rm -rf "/tmp/nereus-$name"
  local t0=$(date +%s.%N)
  NEREUS_STEP_FAULT=1:2 timeout -k 10 "$cap" "$PY" -c "from nereus.cli import nereus; nereus()" train examples/rl/grpo-cpu.nir --algo grpo \
    --nproc "$ranks" --steps 6 --backend "$backend" --json --out "/tmp/nereus-$name" \
    > "$OUT_DIR/$name.out" 2> "$OUT_DIR/$name.log"
  local rc=$?
  local t1=$(date +%s.%N)
  "$PY" - "$OUT_DIR/$name.out" "$rc" "$t0" "$t1" "$backend" "/tmp/nereus-$name" > "$OUT_DIR/$name.json" <<'PYEOF'
import glob, json, sys
path, rc, t0, t1, backend, run = sys.argv[1:]
failed_at = min((json.load(open(p))["time"] for p in glob.glob(run + "/*/error-rank*.json")), default=None)
lines = [l for l in open(path).read().splitlines() if l.strip()]
try:
    error = json.loads(lines[-1]).get("error")
except (IndexError, ValueError):
    error = None
print(json.dumps({"name": "failure", "backend": backend, "exit_code": int(rc), "seconds": float(t1) - float(t0),
                  "seconds_after_failure": None if failed_at is None else float(t1) - failed_at,
                  "error_rank": (error or {}).get("rank"), "error_message": (error or {}).get("message"),
                  "passed": int(rc) == 2 and bool(error) and error.get("rank") == 1}))
PYEOF
  local status="rc=1 (the failure was not surfaced as expected: train exit $rc)"
  grep -q '"passed": true' "$OUT_DIR/$name.json" && status="rc=0 (train exit $rc: rank 1's error surfaced)"
  echo "$name $status, $(cat "$OUT_DIR/$name.json")" | tee -a "$STEPS"
}

HALF=$(( N / 2 ))
QUARTER=$(( N / 4 ))
wanted correctness && run_step "correctness_${N}" "$N" "${CORRECTNESS_CAP_S:-150}" correctness.py
wanted reshard && run_step "reshard_${N}" "$N" "${RESHARD_CAP_S:-270}" reshard.py --modes "${RESHARD_MODES:-device}" \
  --profile-dir "$OUT_DIR"
wanted weight_sync && run_step "weight_sync_${N}" "$N" 100 weight_sync.py
wanted dtensor && run_step "dtensor_${N}" "$N" 90 dtensor_compare.py --profile-dir "$OUT_DIR"
wanted failure && failure_step "failure_${N}" "$N" 60
if wanted reshard && [ "$N" -ge 4 ] && [ $(( N % 4 )) -eq 0 ]; then
  # the smaller doubling (e.g. 2 -> 4 on an 8-GPU host), on the first N/2 GPUs
  run_step "reshard_${HALF}" "$HALF" 150 reshard.py --cases "gpus${QUARTER}-gpus${HALF}"
fi
if wanted correctness && [ "$N" -gt 2 ]; then
  run_step "correctness_2" 2 60 correctness.py --quick
fi
# the steps a default run leaves out (--only offload,moe,variants): offload A -> B -> C with
# host memory, the Qwen3-30B-A3B expert-parallel changes (MOE_LAYERS of its 48 on GPUs), the
# executor variants of the TP -> DP and weight-sync figures
named offload && run_step "offload_${N}" "$N" "${OFFLOAD_CAP_S:-120}" offload_check.py
if named moe; then
  if [ -n "$CPU_RANKS" ]; then run_step "moe_${N}" "$N" "${MOE_CAP_S:-200}" moe_reshard.py
  else run_step "moe_${N}" "$N" "${MOE_CAP_S:-200}" moe_reshard.py --layers "${MOE_LAYERS:-12}"; fi
fi
named variants && run_step "variants_${N}" "$N" "${VARIANTS_CAP_S:-200}" variants.py

echo "=== summary ($(( $(date +%s) - START ))s) ==="
"$PY" benchmarks/multi_gpu/summarize.py "$OUT_DIR"
