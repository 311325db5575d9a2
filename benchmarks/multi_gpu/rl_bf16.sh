#!/usr/bin/env bash
# Issue 14 on GPUs: `nereus train` in bf16 with plan changes, against its control run.
#
#   bash benchmarks/multi_gpu/rl_bf16.sh          # a host with >= 2 GPUs: NCCL, 2 processes
#   bash benchmarks/multi_gpu/rl_bf16.sh --cpu    # the same on CPU with gloo, fewer steps
#
# 1. examples/rl/ppo-bf16-2gpu.nir, PPO on 2 processes, two plan changes (A -> B: TP -> PP;
#    B -> C: PP -> DP and TP 2 on GPUs 1, 0), `--control` (same seeds, no transitions).
# 2. examples/rl/ppo-1gpu.nir, PPO on 1 process (bf16, one layout).
# Output in $OUT/rl_bf16 (./out/rl_bf16 when OUT is unset): <run>.json (the `--json` line
# of `nereus train`), <run>.log (its stderr: progress and table), machine.txt, and
# summary.json (step time, transition time and share of run time, largest step-by-step
# difference to control, over all steps and over the steps before the first rollout that
# differs from the control's, and how many rollouts are equal), also printed last.
# STEPS, EVENTS, LR and BUDGET_S (seconds per run, default 270) override the defaults.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT_DIR="${OUT:-./out}/rl_bf16"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-270}"
CPU=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    *) echo "unknown option $1 (use --cpu)"; exit 2 ;;
  esac
  shift
done
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$CPU" ]; then
  BACKEND=gloo
  STEPS="${STEPS:-3}"
  EVENTS="${EVENTS:-1:B,2:C}"
else
  BACKEND=nccl
  N=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "$N" -lt 2 ]; then
    echo "found $N GPU(s): this needs 2 (use --cpu to check it on CPU)"
    exit 2
  fi
  STEPS="${STEPS:-12}"
  EVENTS="${EVENTS:-1:B,2:C}"
fi
# Both changes come early: in bf16 a sampled token flips once layout-dependent rounding
# moves a sampling boundary (on CPU here: at step 3 of 4), and from then on the two runs
# see different rollouts; steps before that compare like for like.
# 1e-5: the default 3e-3 suits the tiny CPU examples; on this 768-wide actor even 1e-4
# moves the policy far in one step (KL 0.8 at step 2 on CPU, 0.09 with 1e-5).
LR="${LR:-1e-5}"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "backend: $BACKEND  steps: $STEPS  events: $EVENTS  lr: $LR"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [ -z "$CPU" ]; then nvidia-smi -L; fi
} > "$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

# train NAME ARGS...: `nereus train ARGS --json` within the budget; the JSON line to NAME.json.
train() {
  local name="$1"
  shift
  echo ">>> $name: nereus train $*"
  local t0=$(date +%s)
  timeout -k 10 "$BUDGET_S" "$PY" -c "from nereus.cli import nereus; nereus()" train "$@" \
    --backend "$BACKEND" --lr "$LR" --out "$OUT_DIR/$name" --json \
    > "$OUT_DIR/$name.stdout" 2> "$OUT_DIR/$name.log"
  local rc=$?
  tail -n 1 "$OUT_DIR/$name.stdout" > "$OUT_DIR/$name.json"
  echo "$name rc=$rc, $(( $(date +%s) - t0 ))s"
  if [ "$rc" -ne 0 ]; then tail -n 20 "$OUT_DIR/$name.log"; fi
}

train ppo_bf16_2proc examples/rl/ppo-bf16-2gpu.nir --algo ppo --nproc 2 --steps "$STEPS" \
  --events "$EVENTS" --control
train ppo_1proc examples/rl/ppo-1gpu.nir --algo ppo --nproc 1 --steps "$STEPS"

"$PY" - "$OUT_DIR" <<'PYEOF'
import json, os, sys

from nereus.rl.report import summary

out = sys.argv[1]
result = {}
for name in ("ppo_bf16_2proc", "ppo_1proc"):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            run = json.loads(f.read())
    except (OSError, ValueError):
        result[name] = {"error": "no result (see %s.log)" % name}
        continue
    row = summary(run)
    row["transition_seconds_each"] = [t["seconds"] for t in run["transitions"]]
    control = run.get("control")
    if control:
        row["control_mean_step_seconds"] = summary({"steps": control["steps"], "transitions": []})["mean_step_seconds"]
        row.update({k: v for k, v in control.items() if k.startswith("max_abs_diff") or k == "same_sha256"})
        row["steps_with_control_rollouts"] = sum(a["rollout_sha256"] == b["rollout_sha256"]
                                                 for a, b in zip(run["steps"], control["steps"]))
        row["per_step_abs_diff"] = [{k: abs(a[k] - b[k]) for k in ("loss", "value_loss", "kl", "reward")}
                                    for a, b in zip(run["steps"], control["steps"])]
        same = []  # the steps before the first rollout that differs from the control's
        for a, b, diff in zip(run["steps"], control["steps"], row["per_step_abs_diff"]):
            if a["rollout_sha256"] != b["rollout_sha256"]:
                break
            same.append(diff)
        row["max_abs_diff_before_first_rollout_difference"] = {
            k: max((d[k] for d in same), default=None) for k in ("loss", "value_loss", "kl", "reward")}
    result[name] = row
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(result, f, indent=1)
for name, row in result.items():
    print(name, {k: v for k, v in row.items() if k != "per_step_abs_diff"})
print(json.dumps(result))
PYEOF
