"""bf16 PPO and GRPO whose plans change mid-run match their control runs step by step.

Each run starts in plan A and moves A → B → C at step boundaries; its control run keeps A
throughout with the same seeds. The moves cover what the compiler accepts and the loop
must compute on: TP → PP (actor.training tp → pp 2), PP → DP, a GPU-order reversal
(`tp N on N-1, ..., 0`: TP rank 0 on the highest GPU) and tp > kv_heads (replicated KV
heads, in training too: kv_heads 1 on 2 processes, 2 on 4), an offloaded inference
stage (2 processes, plan C) and a dp that does not divide the batch (4 processes, plan C). Models are bf16 (weights,
activations, pipeline messages); master weights, Adam state, log-probs and losses are fp32.
The GRPO workloads declare no reward model: the reward is the task's rule.

Tolerance: the transitions move bytes exactly, so a run differs from its control only
by the order of float additions its layouts imply (TP partial sums all-reduced in bf16,
DP gradients summed in another order, pipeline stages). One bf16 rounding is a relative
2^-9 ≈ 2e-3 (fp32: 2^-24), so log-probs, computed in fp32 from bf16 logits, differ by a
few 1e-3 per token and their means (losses, KL) by ~1e-4: measured here (2-core CPU,
gloo, these seeds) at most 3.5e-4 (loss), 1.1e-4 (KL), 1e-6 (value loss), 0 (reward-model
score), with identical rollouts. TOL = 1e-3 leaves a 3x margin and is 9x under what a
real fault moves: a transition that reverses the actor's lm_head rows (weights and Adam
state, as a gather in the wrong rank order would) moved KL by 9.4e-3 to 2.3e-2 in the
four cases (CI runs the fault in one).
Final fp32 master weights: Adam normalises each gradient, so where a gradient element is
near zero its sign, and so a whole update of size ~lr, is decided by rounding; 2 updates
a step for 3 steps bound the difference by ~6·lr = 1.8e-3 (LR = 3e-4 keeps this small
against weights of scale 0.02; measured ≤ 6.4e-4): MASTER_TOL = 2e-3. bf16 weights are
the masters rounded, so they may differ by one more bf16 ulp (2^-8 of their value).
The bugs this test was written against fail it: the bf16 pipeline message (a crash), an
all-gather in process-group order (`tp 2 on 1, 0`: a rollout differs), replicated KV
rows without their gradient sum (masters differ by 2.8e-3), replica rows split as
batch // dp (with dp 3 two rows get no reference log-probs: KL differs by 0.7).
"""

import numpy as np
import pytest

import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module

pytestmark = pytest.mark.multiprocess

STEPS = 3
LR = 3e-4
EVENTS = ((1, "B"), (2, "C"))
KEYS = ("loss", "value_loss", "kl", "rm_score")
TOL = 1e-3
MASTER_TOL = 2e-3


def _stages(**entries):
    return {k.replace("_", "."): v for k, v in entries.items()}


# 2 processes, kv_heads 1: every tp 2 is tp > kv_heads.
TWO = {
    "A": _stages(actor_generation=(2, 1, (0, 1)), ref_inference=(1, 2, (0, 1)), reward_inference=(2, 1, (0, 1)),
                 actor_training=(1, 2, (0, 1)), critic_training=(2, 1, (0, 1))),
    "B": _stages(actor_training=(1, 1, (0, 1), 2), critic_training=(1, 1, (1, 0), 2),  # TP → PP
                 ref_inference=(1, 1, (0, 1), 2)),
    "C": _stages(actor_training=(2, 1, (0, 1)), critic_training=(1, 2, (1, 0)),  # PP → DP; reversed tp 2
                 actor_generation=(1, 2, (1, 0)), ref_inference=(1, 2, (1, 0), 1, True)),  # offloaded
}
# 4 processes, kv_heads 2: tp 4 replicates each KV head on two ranks.
FOUR = {
    "A": _stages(actor_generation=(2, 2, (0, 1, 2, 3)), ref_inference=(4, 1, (0, 1, 2, 3)),
                 reward_inference=(1, 4, (0, 1, 2, 3)), actor_training=(1, 4, (0, 1, 2, 3)),
                 critic_training=(2, 2, (0, 1, 2, 3))),
    "B": _stages(actor_training=(2, 1, (0, 1, 2, 3), 2), critic_training=(1, 2, (3, 2, 1, 0), 2),  # TP → PP
                 ref_inference=(1, 2, (0, 1, 2, 3), 2), actor_generation=(1, 2, (1, 0, 3, 2), 2)),
    "C": _stages(actor_training=(4, 1, (0, 1, 2, 3)), critic_training=(1, 4, (3, 2, 1, 0)),  # PP → DP; reversed
                 actor_generation=(1, 4, (3, 2, 1, 0)), ref_inference=(3, 1, (3, 2, 1))),  # dp 3: 3+3+2 rows
}


def _fill(plans: dict) -> dict:
    """Stages a later plan leaves out keep plan A's placement."""
    return {name: {**plans["A"], **entries} for name, entries in plans.items()}


class _MisplacesVocab(nr.Runtime):
    """A faulty transition: the actor's lm_head rows (weight and optimizer state) come out
    reversed on every rank, as a gather in the wrong rank order would leave them."""

    def transition(self, plan):
        report = super().transition(plan)
        for name, tensor in self.state("actor.training").items():
            if name.startswith("actor/lm_head.weight"):
                tensor.copy_(tensor.flip(0))
        return report


def _runs(module, algo, faulty=False):
    out = {}
    kinds = [("moved", EVENTS), ("control", ())] + ([("faulty", EVENTS)] if faulty else [])
    for label, events in kinds:
        spec = TrainSpec("A", STEPS, events, seed=3, rl=RlConfig(algo=algo, group=2, lr=LR, critic_lr=LR))
        runtime = _MisplacesVocab(module, "A") if label == "faulty" else nr.Runtime(module, "A")
        result = RlTrainer(module, runtime, spec).run()
        out[label] = {"steps": result["steps"],
                      "final": {n: t.float().numpy() for n, t in result["_final_state"].items()
                                if "#" not in n or n.endswith("#master")}}
    return out


def _largest_differences(moved: dict, control: dict) -> dict:
    """Largest |moved − control| per step value and over the final weights."""
    keys = KEYS
    assert [s["plan"] for s in moved["steps"]] == ["A", "B", "C"]
    pairs = list(zip(moved["steps"], control["steps"]))
    if all(a["rm_score"] is None and b["rm_score"] is None for a, b in pairs):  # no reward model
        keys = tuple(k for k in KEYS if k != "rm_score")
    diffs = {k: max(abs(a[k] - b[k]) for a, b in pairs) for k in keys}
    diffs["rollouts"] = sum(a["rollout_sha256"] != b["rollout_sha256"] for a, b in pairs)
    diffs["rewards"] = sum(a["reward"] != b["reward"] for a, b in pairs)
    weights = [n for n in moved["final"] if "#" not in n]
    diffs["masters"] = max(float(np.abs(moved["final"][n] - control["final"][n]).max())
                           for n in moved["final"] if "#" in n)
    diffs["weights_beyond_an_ulp"] = max(float((np.abs(moved["final"][n] - control["final"][n])
                                                - 2.0 ** -8 * np.abs(control["final"][n])).max()) for n in weights)
    return diffs


@pytest.mark.parametrize("world, algo", [(2, "ppo"), (2, "grpo"), (4, "ppo"), (4, "grpo")])
def test_bf16_run_with_transitions_matches_its_control(world, algo):
    plans = _fill(TWO if world == 2 else FOUR)
    module = tiny_module(plans, gpus=world, batch=8, prompt=5, response=4, algo=algo, dtype="bf16",
                         kv_heads=1 if world == 2 else 2, reward_model=algo == "ppo")
    with_fault = (world, algo) == (2, "ppo")  # the check can fail: once is enough (CI time)
    runs = run_world(world, _runs, module, algo, with_fault)
    diffs = _largest_differences(runs["moved"], runs["control"])
    assert diffs["rollouts"] == 0 and diffs["rewards"] == 0, diffs
    for key in KEYS:
        assert diffs.get(key, 0.0) < TOL, (key, diffs)
    assert diffs["masters"] < MASTER_TOL and diffs["weights_beyond_an_ulp"] < MASTER_TOL, diffs
    if with_fault:
        fault = _largest_differences(runs["faulty"], runs["moved"])
        assert fault["kl"] > 5 * TOL, fault
