"""The cost model against real steps: `nereus train --controller` with a drift, on this machine.

    PYTHONPATH=. python benchmarks/controller_real_steps.py [--steps 24] [--nproc 2]
        [--plan-file examples/rl/grpo-cpu.nir] [--events "8:S2,16:S3"]
        [--drift "6:response=8,12:response=12,18:response=16"] [--backend nccl] [--extra ARGS]

Runs the RL loop with the controller observing every step (scripted --events force
transitions so that their estimates are checked too; the controller may add its own). Each
decision record carries the model's one-step-ahead prediction of the step just measured,
made before the model learned from it (nereus/rl/adaptive.py), and of the transition just
made. Reports MAPE per model-stage and for the whole step — over all steps, and over the
steps after the model's first 3 observations — and the transitions' predicted vs measured
seconds. Writes benchmarks/data/controller_real_steps_TAG.json (TAG: cpu, or the backend's
name with --backend nccl); the last line printed is that summary as one JSON object.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mape(pairs):
    pairs = [(p, m) for p, m in pairs if m > 0]
    return 100 * statistics.mean(abs(p / m - 1) for p, m in pairs) if pairs else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan-file", default="examples/rl/grpo-cpu.nir")
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--events", default="8:S2,16:S3")
    parser.add_argument("--drift", default="6:response=8,12:response=12,18:response=16")
    parser.add_argument("--extra", default="", help="more `nereus train` arguments")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="`nereus train --backend` (nccl: one GPU per process)")
    parser.add_argument("--tag", help="file suffix (default: cpu, or the backend with --backend nccl)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    command = [sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", args.plan_file,
               "--algo", args.algo, "--nproc", str(args.nproc), "--steps", str(args.steps), "--controller",
               "--events", args.events, "--drift", args.drift, "--backend", args.backend, "--json",
               *args.extra.split()]
    tag = args.tag or ("cpu" if args.backend != "nccl" else args.backend)
    # this checkout first, and whatever the caller's PYTHONPATH holds after it (where lark
    # and the other dependencies may be installed, e.g. --target directories)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    if done.returncode != 0:
        sys.exit(f"nereus train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    checks = [d for d in result["decisions"] if d and "predicted_stage_s" in d]
    stages = sorted({ms for d in checks for ms in d["measured_stage_s"]})
    per_stage, per_stage_warm = {}, {}
    for ms in stages:
        rows = [(d["predicted_stage_s"][ms], d["measured_stage_s"][ms]) for d in checks if ms in d["predicted_stage_s"]]
        per_stage[ms] = mape(rows)
        per_stage_warm[ms] = mape(rows[args.warmup:])
    steps = [(d["predicted_step_s"], d["measured_step_s"]) for d in checks]
    moves = [d["transition"] for d in checks if "transition" in d]
    out = {"command": "PYTHONPATH=. python benchmarks/controller_real_steps.py " + " ".join(sys.argv[1:]),
           "train_command": " ".join(command[3:]), "machine": platform.platform(),
           "stage_mape_pct": per_stage, f"stage_mape_after_{args.warmup}_pct": per_stage_warm,
           "step_mape_pct": mape(steps), f"step_mape_after_{args.warmup}_pct": mape(steps[args.warmup:]),
           "transitions": moves, "transition_mape_pct": mape([(m["predicted_s"], m["measured_s"]) for m in moves]),
           "checks": checks, "plan_per_step": [d["plan"] for d in checks],
           "measured_transitions": result["transitions"]}
    path = os.path.join(HERE, "data", f"controller_real_steps_{tag}.json")
    with open(path, "w") as handle:
        json.dump(out, handle, indent=1)
        handle.write("\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("checks", "measured_transitions")}))  # one line, last


if __name__ == "__main__":
    main()
