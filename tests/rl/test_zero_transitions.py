"""GRPO on 4 gloo processes whose actor trains with `zero 1` and `zero 3`
(examples/rl/grpo-zero-cpu.nir): each dp replica holds and updates a dim-0 chunk of the
fp32 master and Adam state, then the replicas all-gather the updated weights (zero 1) or
gather the weight chunks when a forward needs them (zero 3; nereus.rl.zero).

- zero 1 and zero 3 reproduce zero 0 bit for bit: the example's first plan run as is,
  with `zero 3` and with zero removed give identical steps and final weights (Adam is
  elementwise, the gradients are the same all-reduced sums, the all-gathers copy bytes).
- Plan changes through zero layouts (dp 2 → 4 under zero 1 with tp 2 → 1, zero 1 → 0 with
  pp 2 on reversed GPUs, zero 0 → 3) lose nothing: the Nereus run equals the in-memory
  gather-and-reshard run (same layouts every step) bit for bit, and its control run (no
  plan change) within the reduction-order tolerance of tests/rl/test_transitions.py.
- The check can fail: a transition that leaves one replica's chunk of the actor's Adam
  state zeroed (as a lost chunk would) moves the run far beyond the tolerance.
- bf16 PPO with the actor and the critic under zero 1 / zero 3 (built with tiny_module):
  bit-identical to zero 0, equal to the gather-and-reshard run through a plan change that
  swaps their zero levels and changes dp, within tests/rl/test_bf16_transitions.py's
  tolerances of its control run.
"""

import pathlib
from dataclasses import replace

import numpy as np
import pytest

import nereus.ir as ir
import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.restart import RestartRuntime
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module, uniform

pytestmark = pytest.mark.multiprocess

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples/rl/grpo-zero-cpu.nir"
STEPS = 4
EVENTS = ((1, "S2"), (2, "S3"), (3, "S4"))
TOL = 1e-5  # as tests/rl/test_transitions.py: fp32, a few ulps of reordered sums per step


class _LosesAChunk(nr.Runtime):
    """A faulty transition: the last replica's chunk of the actor's exp_avg comes out zeroed."""

    def transition(self, plan):
        report = super().transition(plan)
        role_last = max(self.module.plan(plan).placement("actor.training").gpus)
        if self.rank == role_last:
            for name, tensor in self.state("actor.training").items():
                if name.endswith("#exp_avg"):
                    tensor.zero_()
        return report


def _numbers(step: dict) -> dict:
    return {k: v for k, v in step.items() if k not in ("seconds", "stage_seconds", "reward_seconds", "sync_seconds", "sync_bytes", "plan")}


def _runs(source: str):
    module = ir.parse_source(source, "grpo-zero-cpu.nir")
    first = source.index("plan S1")  # the first plan's zero 1 replaced; later plans as written
    zero0 = ir.parse_source(source[:first] + source[first:].replace("on 0..3  zero 1", "on 0..3", 1), "zero0.nir")
    zero3 = ir.parse_source(source[:first] + source[first:].replace("zero 1", "zero 3", 1), "zero3.nir")
    assert zero0.plan("S1").placement("actor.training").zero == 0
    assert zero3.plan("S1").placement("actor.training").zero == 3
    kinds = [("nereus", module, nr.Runtime, EVENTS), ("restart", module, RestartRuntime, EVENTS),
             ("control", module, nr.Runtime, ()), ("zero0", zero0, nr.Runtime, ()), ("zero3", zero3, nr.Runtime, ()),
             ("faulty", module, _LosesAChunk, EVENTS)]
    out = {}
    for label, mod, runtime, events in kinds:
        spec = TrainSpec("S1", STEPS, events, seed=5, rl=RlConfig(algo="grpo", group=4))
        result = RlTrainer(mod, runtime(mod, "S1"), spec).run()
        out[label] = {"steps": result["steps"], "sha": result["final_weights_sha256"],
                      "transitions": result["transitions"],
                      "final": {n: t.float().numpy() for n, t in result["_final_state"].items()
                                if "#" not in n or n.endswith("#master")}}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(4, _runs, EXAMPLE.read_text(), timeout=600)


@pytest.mark.parametrize("zero", ["control", "zero3"])  # the control run is zero 1
def test_zero_1_and_3_reproduce_zero_0_bit_for_bit(runs, zero):
    assert runs[zero]["sha"] == runs["zero0"]["sha"]
    assert [_numbers(s) for s in runs[zero]["steps"]] == [_numbers(s) for s in runs["zero0"]["steps"]]
    for name, tensor in runs[zero]["final"].items():
        assert np.array_equal(tensor, runs["zero0"]["final"][name]), name


def test_nereus_moves_zero_state_as_the_gather_and_reshard_run_does(runs):
    moved = runs["nereus"]
    assert [s["plan"] for s in moved["steps"]] == ["S1", "S2", "S3", "S4"]
    assert [_numbers(s) for s in moved["steps"]] == [_numbers(s) for s in runs["restart"]["steps"]]
    assert moved["sha"] == runs["restart"]["sha"]
    assert all(t["bytes"] > 0 for t in moved["transitions"])


def test_run_through_zero_layouts_matches_its_control(runs):
    moved, control = runs["nereus"], runs["control"]
    for a, b in zip(moved["steps"], control["steps"]):
        for key in ("loss", "kl"):
            assert abs(a[key] - b[key]) < TOL, (a["step"], key, a[key], b[key])
        assert a["reward"] == b["reward"] and a["rollout_sha256"] == b["rollout_sha256"], a["step"]
    for name, tensor in moved["final"].items():
        assert np.abs(tensor - control["final"][name]).max() < TOL, name


def test_a_lost_optimizer_chunk_is_caught(runs):
    faulty, moved = runs["faulty"], runs["nereus"]
    assert _numbers(faulty["steps"][0]) == _numbers(moved["steps"][0])
    worst = max(float(np.abs(faulty["final"][n] - moved["final"][n]).max()) for n in moved["final"])
    assert worst > 100 * TOL, worst


# PPO, bf16 models, actor and critic both under zero: the critic's value head ([1, hidden])
# leaves dp replica 1 an empty chunk (no master, and under zero 3 no weight either).
PPO_PLANS = {"P1": {**uniform(2, 2, range(4)), "actor.generation": (4, 1, (0, 1, 2, 3))},
             "P2": {"actor.training": (4, 1, (0, 1, 2, 3)), "critic.training": (4, 1, (3, 2, 1, 0))}}
PPO_ZERO = {"P1": {"actor.training": 1, "critic.training": 3}, "P2": {"actor.training": 3, "critic.training": 1}}
BF16_TOL, BF16_MASTER_TOL = 1e-3, 2e-3  # as tests/rl/test_bf16_transitions.py (reduction order in bf16)


def _with_zero(module, zeros: dict):
    plans = []
    for plan in module.plans:
        placements = tuple(replace(p, zero=zeros.get(plan.name, {}).get(str(p.model_stage), 0))
                           for p in plan.placements)
        plans.append(replace(plan, declared=placements, placements=placements))
    return replace(module, plans=tuple(plans))


def _ppo_runs():
    base = tiny_module(PPO_PLANS, batch=8, prompt=5, response=4, dtype="bf16", reward_model=False)
    zero = _with_zero(base, PPO_ZERO)
    kinds = [("nereus", zero, nr.Runtime, ((1, "P2"),)), ("restart", zero, RestartRuntime, ((1, "P2"),)),
             ("control", zero, nr.Runtime, ()), ("zero0", base, nr.Runtime, ())]
    out = {}
    for label, module, runtime, events in kinds:
        spec = TrainSpec("P1", 2, events, seed=3, rl=RlConfig(algo="ppo", lr=3e-4, critic_lr=3e-4))
        result = RlTrainer(module, runtime(module, "P1"), spec).run()
        out[label] = {"steps": result["steps"], "sha": result["final_weights_sha256"],
                      "final": {n: t.float().numpy() for n, t in result["_final_state"].items()
                                if "#" not in n or n.endswith("#master")}}
    return out


def test_bf16_ppo_with_zero_actor_and_critic_matches_zero_0_and_its_control():
    runs = run_world(4, _ppo_runs, timeout=600)
    control, moved = runs["control"], runs["nereus"]
    assert control["sha"] == runs["zero0"]["sha"]  # zero 1 / zero 3 change no bit
    assert [_numbers(s) for s in control["steps"]] == [_numbers(s) for s in runs["zero0"]["steps"]]
    assert [s["plan"] for s in moved["steps"]] == ["P1", "P2"]
    assert moved["sha"] == runs["restart"]["sha"]
    for a, b in zip(moved["steps"], control["steps"]):
        for key in ("loss", "value_loss", "kl"):
            assert abs(a[key] - b[key]) < BF16_TOL, (a["step"], key, a[key], b[key])
        assert a["rollout_sha256"] == b["rollout_sha256"], a["step"]
    for name, tensor in moved["final"].items():
        assert np.abs(tensor - control["final"][name]).max() < BF16_MASTER_TOL + (
            0 if "#" in name else 2.0 ** -8 * np.abs(control["final"][name]).max()), name
