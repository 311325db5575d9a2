"""GRPO on 4 gloo processes whose actor trains with `zero 1` (examples/rl/grpo-zero-cpu.nir):
each dp replica holds and updates a dim-0 chunk of the fp32 master and Adam state, then
the replicas all-gather the updated weights (nereus.rl.zero).

- zero 1 reproduces zero 0 bit for bit: the example's first plan run as is and with
  `zero 1` removed give identical steps and final weights (Adam is elementwise, the
  gradients are the same all-reduced sums, the all-gather copies bytes).
- Plan changes through zero layouts (dp 2 → 4 under zero 1 with tp 2 → 1, zero 1 → 0 with
  pp 2 on reversed GPUs, zero 0 → 1) lose nothing: the Nereus run equals the in-memory
  gather-and-reshard run (same layouts every step) bit for bit, and its control run (no
  plan change) within the reduction-order tolerance of tests/rl/test_transitions.py.
- The check can fail: a transition that leaves one replica's chunk of the actor's Adam
  state zeroed (as a lost chunk would) moves the run far beyond the tolerance.
"""

import pathlib

import numpy as np
import pytest

import nereus.ir as ir
import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.restart import RestartRuntime
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world

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
    return {k: v for k, v in step.items() if k not in ("seconds", "stage_seconds", "sync_bytes", "plan")}


def _runs(source: str):
    module = ir.parse_source(source, "grpo-zero-cpu.nir")
    zero0 = ir.parse_source(source.replace("on 0..3  zero 1", "on 0..3"), "grpo-zero0.nir")
    kinds = [("nereus", module, nr.Runtime, EVENTS), ("restart", module, RestartRuntime, EVENTS),
             ("control", module, nr.Runtime, ()), ("zero0", zero0, nr.Runtime, ()),
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


def test_zero_1_reproduces_zero_0_bit_for_bit(runs):
    assert runs["control"]["sha"] == runs["zero0"]["sha"]
    assert [_numbers(s) for s in runs["control"]["steps"]] == [_numbers(s) for s in runs["zero0"]["steps"]]
    for name, tensor in runs["control"]["final"].items():
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
