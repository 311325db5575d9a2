"""Four gloo processes: a PPO run that changes TP/PP degrees and then GPU counts mid-run
matches (a) the same run with in-memory gather-and-reshard transitions bit for bit when
Nereus moves the state, (b) a control run without transitions step by step within a
reduction-order tolerance, and (c) a tp = 1 single-GPU reference at step 1.

Tolerance: layouts differ only in how sums are split (TP partial sums all-reduced, DP
gradients summed in another order), so fp32 results differ by a few ulps per step; the
largest differences measured here are 1.5e-7 on losses/KL and 4e-7 on final weights over 4 steps (Adam
amplifies ulps on near-zero gradients). TOL = 1e-5 leaves a 25x margin and is far below
a real fault: a misplaced shard (the corrupting runtime below) moves loss + KL by 4e-4."""

import pytest
import numpy as np

import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.restart import RestartRuntime
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module, uniform

pytestmark = pytest.mark.multiprocess

S1 = {**uniform(2, 2, range(4)), "actor.generation": (4, 1, (0, 1, 2, 3)), "reward.inference": (1, 2, (2, 3))}
S2 = {**S1, "actor.generation": (1, 2, (0, 1, 2, 3), 2),  # TP/PP change
      "actor.training": (2, 1, (0, 1, 2, 3), 2), "ref.inference": (4, 1, (0, 1, 2, 3))}
S3 = {**S2, "reward.inference": (4, 1, (0, 1, 2, 3)), "actor.training": (1, 2, (0, 1)),  # GPU counts
      "critic.training": (1, 1, (3, 2), 2)}
REF = uniform(1, 1, (0,))
PLANS = {"S1": S1, "S2": S2, "S3": S3, "R": REF}
EVENTS = ((1, "S2"), (2, "S3"))
STEPS = 3


TOL = 1e-5


class _SwapsHeads(RestartRuntime):
    """A faulty transition: the actor's first layer gets its q heads' rows reversed."""

    def transition(self, plan):
        report = super().transition(plan)
        for name, tensor in self.state("actor.training").items():
            if name.startswith("actor/layers.0.attn.qkv.weight"):
                tensor[: tensor.shape[0] // 2] = tensor[: tensor.shape[0] // 2].flip(0).clone()
        return report


def _runtime(kind, module, plan):
    if kind == "faulty":
        return _SwapsHeads(module, plan)
    if kind == "nereus":
        return nr.Runtime(module, plan)
    return RestartRuntime(module, plan)


def _numbers(step: dict) -> dict:
    """A step record without its timings."""
    return {k: v for k, v in step.items() if k not in ("seconds", "stage_seconds", "reward_seconds", "sync_seconds", "sync_bytes")}


def _runs(kinds):
    module = tiny_module(PLANS, batch=8, prompt=5, response=4)
    out = {}
    for label, kind, plan, events in kinds:
        spec = TrainSpec(plan, STEPS, events, seed=7, rl=RlConfig(algo="ppo"))
        result = RlTrainer(module, _runtime(kind, module, plan), spec).run()
        out[label] = result
    return {k: {"steps": v["steps"], "sha": v["final_weights_sha256"],
                "final": {n: t.numpy() for n, t in v["_final_state"].items() if "#" not in n}}
            for k, v in out.items()}


def test_transitions_lose_nothing():
    kinds = [("restart", "restart", "S1", EVENTS), ("control", "restart", "S1", ()), ("ref", "restart", "R", ()),
             ("faulty", "faulty", "S1", EVENTS)]
    kinds.insert(0, ("nereus", "nereus", "S1", EVENTS))
    runs = run_world(4, _runs, kinds)
    moved = runs["nereus"]
    assert [s["plan"] for s in moved["steps"]] == ["S1", "S2", "S3"]
    # same layouts at every step as the gather-and-reshard run: identical bits
    assert [_numbers(s) for s in moved["steps"]] == [_numbers(s) for s in runs["restart"]["steps"]]
    assert moved["sha"] == runs["restart"]["sha"]
    for a, b in zip(moved["steps"], runs["control"]["steps"]):
        for key in ("loss", "value_loss", "kl", "rm_score"):
            assert abs(a[key] - b[key]) < TOL, (a["step"], key, a[key], b[key])
        assert a["reward"] == b["reward"], a["step"]
    for name, tensor in moved["final"].items():
        assert np.abs(tensor - runs["control"]["final"][name]).max() < TOL, name
    for a, ref in zip(moved["steps"], runs["ref"]["steps"]):  # TP/DP layers vs plain tp = 1
        for key in ("loss", "value_loss", "kl", "rm_score", "reward"):
            assert abs(a[key] - ref[key]) < TOL, (a["step"], key, a[key], ref[key])
    faulty = runs["faulty"]["steps"]  # the check can fail: a misplaced shard is caught
    assert _numbers(faulty[0]) == _numbers(moved["steps"][0])
    assert max(abs(f["loss"] - m["loss"]) + abs(f["kl"] - m["kl"]) for f, m in zip(faulty[1:], moved["steps"][1:])) > 10 * TOL
