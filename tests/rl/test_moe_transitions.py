"""Four gloo processes: PPO and GRPO train a tiny Qwen3-MoE (examples/rl/ppo-moe-cpu.nir:
4 experts, 2 per token) through plan changes from expert-parallel layouts to tensor-
parallel ones and back (E -> T -> E2), and match the control run (the same run staying
in plan E) step by step and in the final weights.

Tolerance as tests/rl/test_transitions.py: layouts differ only in how sums are split (TP
partial sums, DP·EP gradient sums, the order in which an EP rank's experts add into a
token), so fp32 results differ by a few ulps per step; TOL = 1e-5. A misplaced expert
(the corrupting runtime below swaps two experts of the actor after the first
transition) moves the loss far beyond it, so the check can fail."""

from pathlib import Path

import numpy as np
import pytest

import nereus.ir as ir
import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world

pytestmark = pytest.mark.multiprocess

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/rl/ppo-moe-cpu.nir"
EVENTS = ((1, "T"), (2, "E2"))
STEPS = 3
TOL = 1e-5


class _SwapsExperts(nr.Runtime):
    """A faulty transition: after it, the actor's experts 0 and 1 of layer 0 trade their
    gate_up weights wherever one rank holds both (tensor-parallel plan T)."""

    def transition(self, target, **options):
        report = super().transition(target, **options)
        state = self.state("actor.training")
        a, b = "actor/layers.0.mlp.experts.0.gate_up.weight", "actor/layers.0.mlp.experts.1.gate_up.weight"
        if a in state and b in state:
            saved = state[a].clone()
            state[a].copy_(state[b])
            state[b].copy_(saved)
        return report


def _numbers(step: dict) -> dict:
    return {k: v for k, v in step.items() if k not in ("seconds", "stage_seconds", "reward_seconds", "sync_seconds", "sync_bytes")}


def _runs(algo: str, dtype: str = "fp32", faulty: bool = True):
    module = ir.parse_source(EXAMPLE.read_text().replace("dtype fp32", f"dtype {dtype}"), str(EXAMPLE))
    out = {}
    kinds = [("moved", nr.Runtime, EVENTS), ("control", nr.Runtime, ())] + \
        ([("faulty", _SwapsExperts, EVENTS)] if faulty else [])
    for label, runtime, events in kinds:
        rl = RlConfig(algo=algo) if dtype == "fp32" else RlConfig(algo=algo, lr=3e-4, critic_lr=3e-4)
        spec = TrainSpec("E", STEPS, events, seed=5, rl=rl)
        result = RlTrainer(module, runtime(module, "E"), spec).run()
        out[label] = {"steps": result["steps"], "transitions": result["transitions"],
                      "final": {n: t.float().numpy() for n, t in result["_final_state"].items() if "#" not in n}}
    return out


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_moe_training_through_ep_tp_plan_changes_matches_its_control(algo):
    runs = run_world(4, _runs, algo, timeout=600)
    moved, control = runs["moved"], runs["control"]
    assert [s["plan"] for s in moved["steps"]] == ["E", "T", "E2"]
    assert [t["to"] for t in moved["transitions"]] == ["T", "E2"] and all(t["bytes"] > 0 for t in moved["transitions"])
    assert _numbers(moved["steps"][0]) == _numbers(control["steps"][0])  # same plan, same bits
    for a, b in zip(moved["steps"], control["steps"]):
        assert a["reward"] == b["reward"] and a["rollout_sha256"] == b["rollout_sha256"], a["step"]
    assert len({s["loss"] for s in control["steps"]}) == STEPS  # it trains: the loss changes
    assert _deviation(moved, control) < TOL
    assert _deviation(runs["faulty"], control) > 10 * TOL  # the check can fail: a misplaced expert is caught


def _deviation(run: dict, control: dict) -> float:
    """The largest difference from the control run: step losses, KL, final weights."""
    steps = max(abs(a[key] - b[key]) for a, b in zip(run["steps"], control["steps"])
                for key in ("loss", "value_loss", "kl"))
    weights = max(float(np.abs(tensor - control["final"][name]).max()) for name, tensor in run["final"].items())
    return max(steps, weights)


def test_bf16_moe_training_through_ep_tp_plan_changes_matches_its_control():
    """bf16 weights and activations (routing weights, all-to-all messages), fp32 masters and
    Adam: the tolerance of tests/rl/test_bf16_transitions.py (TOL 1e-3: bf16 partial sums
    in other orders move losses by ~1e-4; measured here 3.3e-5 loss, 1.6e-5 KL); the
    rollouts are identical (no top-k choice flipped). The fault check is the fp32 one's."""
    runs = run_world(4, _runs, "ppo", "bf16", False, timeout=600)
    moved, control = runs["moved"], runs["control"]
    assert [s["plan"] for s in moved["steps"]] == ["E", "T", "E2"]
    for a, b in zip(moved["steps"], control["steps"]):
        assert a["rollout_sha256"] == b["rollout_sha256"] and a["reward"] == b["reward"], a["step"]
        for key in ("loss", "value_loss", "kl"):
            assert abs(a[key] - b[key]) < 1e-3, (a["step"], key, a[key], b[key])
