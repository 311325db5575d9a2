"""Summaries of `nereus train` results: the run table, the run-vs-control comparison and
the reward/KL plot (against step and against wall-clock time). Results are the dicts the
worker writes to OUT/result.json. Torch is only needed to compare final weights and
matplotlib only to plot.
"""

from __future__ import annotations

import os
from typing import Optional


def summary(result: dict) -> dict:
    """Steps, mean step time, transitions, bytes moved, transition share of run time, and
    apart from the transitions the generation engines' restarts after them (a transition's
    `engine_seconds`: vLLM engines started again where the generation layout moved)."""
    steps = result["steps"]
    moved = sum(t["bytes"] for t in result["transitions"])
    transition_seconds = sum(t["seconds"] for t in result["transitions"])
    engine_seconds = sum(t.get("engine_seconds", 0.0) for t in result["transitions"])
    run = result.get("run_seconds") or sum(s["seconds"] for s in steps) + transition_seconds + engine_seconds
    return {"steps": len(steps), "mean_step_seconds": sum(s["seconds"] for s in steps) / max(1, len(steps)),
            "transitions": len(result["transitions"]), "bytes_moved": moved,
            "transition_seconds": transition_seconds, "run_seconds": run,
            "transition_share": transition_seconds / run if run else 0.0,
            "engine_restart_seconds": engine_seconds, "engine_restart_share": engine_seconds / run if run else 0.0,
            "first_reward": steps[0]["reward"] if steps else None, "last_reward": steps[-1]["reward"] if steps else None,
            # rank 0's weight-sync bytes, and what full syncs would have sent (equal unless --sync delta)
            "sync_bytes": sum(s.get("sync_bytes", 0) for s in steps),
            "sync_dense_bytes": sum(s.get("sync_dense_bytes", s.get("sync_bytes", 0)) for s in steps),
            "sync_reference_bytes": max((s.get("sync_reference_bytes", 0) for s in steps), default=0)}


def compare(run: dict, control: dict, run_state: Optional[str] = None, control_state: Optional[str] = None) -> dict:
    """Largest per-step differences of loss, value loss, reward and KL between two runs,
    and of the final weights when both OUT/final_state.pt paths are given."""
    out = {}
    for key in ("loss", "value_loss", "reward", "kl"):
        # NaN wins (max() would drop it or not depending on the order)
        out[f"max_abs_diff_{key}"] = max((abs(a[key] - b[key]) for a, b in zip(run["steps"], control["steps"])),
                                         default=0.0, key=lambda d: (d != d, d))
    out["same_sha256"] = run["final_weights_sha256"] == control["final_weights_sha256"]
    if run_state and control_state and os.path.exists(run_state) and os.path.exists(control_state):
        import torch

        a, b = torch.load(run_state), torch.load(control_state)
        out["max_abs_diff_final_weights"] = max(float((a[n] - b[n]).abs().max()) for n in a if "#" not in n)
    return out


def plot(runs: dict[str, dict], path: str) -> str:
    """Reward and KL against step and against wall-clock seconds, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for label, result in runs.items():
        steps = [s["step"] for s in result["steps"]]
        clock, elapsed = [], 0.0
        pauses = {t["after_step"]: t["seconds"] + t.get("engine_seconds", 0.0) for t in result["transitions"]}
        for s in result["steps"]:
            elapsed += s["seconds"]
            clock.append(elapsed)
            elapsed += pauses.get(s["step"], 0.0)
        for row, key in enumerate(("reward", "kl")):
            values = [s[key] for s in result["steps"]]
            axes[row][0].plot(steps, values, marker=".", label=label)
            axes[row][1].plot(clock, values, marker=".", label=label)
            axes[row][0].set_ylabel(key)
        for t in result["transitions"]:
            for row in range(2):
                axes[row][0].axvline(t["after_step"] + 0.5, color="grey", linestyle=":", linewidth=1)
    axes[1][0].set_xlabel("step")
    axes[1][1].set_xlabel("wall-clock seconds")
    axes[0][0].legend()
    fig.suptitle("Nereus RL run with plan transitions (dotted) vs control")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
