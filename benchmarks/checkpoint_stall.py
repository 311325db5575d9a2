"""What asynchronous checkpoints cost a training step, and what a resume into another plan
reads (`nereus train --save-every`, `--resume`; nereus.rl.checkpoint).

Runs `nereus train` on a CPU plan (gloo) `--repeats` times each without per-step saves
(`--save-every 0`: only the final state, after the last step), with a save after every
step (`--save-every 1`) and with a save every `--every` steps, rotating the order, same
seeds and transitions. Per run: the median step seconds over steps 2 .. N-1 (step 1 warms
the processes' caches; the last step's save is outside the loop); per save (rank 0's
figures) the stall on the training thread, staging (copying this rank's boxes) plus
waiting for the save before it, and the background write's wall and CPU seconds. The
`--every` runs also give a paired figure on one machine state: the median of the steps
that run while a save is written (the step right after it) against the median of the
other steps of the same run (a shared machine's load moves slowly compared with a step).
Then a saving run is resumed from its last checkpoint in another plan with no step to
run, and the bytes each rank read are compared with the bytes its new shards hold.

    PYTHONPATH=. python benchmarks/checkpoint_stall.py [--steps 30] [--repeats 3]

Last stdout line: {"name": "checkpoint_stall", ...}; --json-out writes the same object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _train(args: list, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", *args, "--json"],
                         capture_output=True, text=True, env=env, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"nereus train failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan-file", default=os.path.join(ROOT, "examples", "rl", "grpo-cpu.nir"))
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--events", default="10:S2,20:S3")
    parser.add_argument("--resume-plan", default="S1", help="plan to resume the saving run in")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=4, help="the paired runs' --save-every")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    common = [args.plan_file, "--algo", args.algo, "--nproc", str(args.nproc), "--steps", str(args.steps),
              "--events", args.events, "--samples-every", "0"]
    work = tempfile.mkdtemp(prefix="nereus-ckpt-bench-")
    runs = []
    started = time.time()
    for repeat in range(args.repeats):
        order = [0, 1, args.every][repeat % 3:] + [0, 1, args.every][:repeat % 3]
        for every in order:
            out = os.path.join(work, f"r{repeat}-every{every}")
            result = _train(common + ["--save-every", str(every), "--keep", "2", "--out", out], env)
            steps = [s for s in result["steps"] if 1 < s["step"] < args.steps]
            times = [s["seconds"] for s in steps]
            saves = [c for c in result["checkpoints"] if c["step"] < args.steps]
            stalls = [c["stall_seconds"] for c in saves]
            run = {"repeat": repeat, "save_every": every, "out": out, "median_step_s": statistics.median(times),
                   "step_seconds": times, "saves": len(saves),
                   "median_stall_s": statistics.median(stalls) if stalls else 0.0,
                   "max_stall_s": max(stalls) if stalls else 0.0,
                   "median_write_s": statistics.median(c["write_seconds"] for c in saves) if saves else 0.0,
                   "median_write_cpu_s": statistics.median(c["write_cpu_seconds"] for c in saves) if saves else 0.0,
                   "rank0_bytes_per_save": saves[-1]["rank_bytes"] if saves else 0,
                   "final_sha256": result["final_weights_sha256"]}
            if every > 1:  # the step right after a save runs beside its write
                beside = [s["seconds"] for s in steps if (s["step"] - 1) % every == 0]
                alone = [s["seconds"] for s in steps if (s["step"] - 1) % every != 0]
                run.update(median_step_s_beside_a_write=statistics.median(beside),
                           median_step_s_other_steps=statistics.median(alone))
            runs.append(run)
    without = statistics.median(r["median_step_s"] for r in runs if r["save_every"] == 0)
    saving = [r for r in runs if r["save_every"] == 1]
    with_save = statistics.median(r["median_step_s"] for r in saving)
    stall = statistics.median(r["median_stall_s"] for r in saving)
    paired = [r for r in runs if r["save_every"] == args.every]
    beside = statistics.median(r["median_step_s_beside_a_write"] for r in paired)
    other = statistics.median(r["median_step_s_other_steps"] for r in paired)
    paired_stall = statistics.median(r["median_stall_s"] for r in paired)
    resumed = _train(["--resume", saving[-1]["out"], "--plan", args.resume_plan, "--steps", str(args.steps),
                      "--out", saving[-1]["out"]], env)["resumed"]
    summary = {
        "name": "checkpoint_stall", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end)",
        "plan_file": os.path.relpath(args.plan_file, ROOT), "nproc": args.nproc, "steps": args.steps,
        "events": args.events, "repeats": args.repeats,
        "median_step_s_without_saves": without, "median_step_s_saving_every_step": with_save,
        "median_stall_s_per_save": stall,
        "step_slowdown": with_save / without - 1, "stall_share_of_step": stall / without,
        "total_share_of_step": (with_save + stall) / without - 1,
        "median_write_s": statistics.median(r["median_write_s"] for r in saving),
        "median_write_cpu_s": statistics.median(r["median_write_cpu_s"] for r in saving),
        "paired": {"save_every": args.every, "median_step_s_beside_a_write": beside,
                   "median_step_s_other_steps": other, "median_stall_s": paired_stall,
                   "slowdown_beside_a_write": beside / other - 1,
                   "stall_and_slowdown_share_of_step": (beside - other + paired_stall) / other},
        "same_final_weights": len({r["final_sha256"] for r in runs}) == 1,
        "resume": {"from_plan": resumed["saved_plan"], "into_plan": resumed["plan"], "step": resumed["step"],
                   "bytes_read": resumed["total_bytes_read"], "new_layout_bytes": resumed["total_layout_bytes"],
                   "trainer_state_bytes": resumed["total_state_bytes"], "rank0_seconds": resumed["seconds"]},
        "runs": [{k: v for k, v in r.items() if k != "out"} for r in runs],
    }
    if args.json_out:
        with open(args.json_out, "w") as handle:
            json.dump(summary, handle, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
