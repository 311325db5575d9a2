"""The RL loop with `--sync delta` and with FP8 generation weights (`quant fp8`), 2 gloo
processes, bf16 GRPO, greedy rollouts:
  - delta syncs give the rollouts, rewards and final weights of dense syncs bit for bit,
    send a small part of the dense bytes after each full one (the first sync, a plan
    change that moves the generation layout, every `full_every`);
  - FP8 generation trains (finite losses), its syncs send about half the bf16 bytes, and
    the generation engine computes with nereus.models.fp8.Fp8Weight.
Plans: A (generation dp 2, training tp 2: every sync crosses ranks), B (generation tp 2
on 1, 0: the generation layout moves)."""

from dataclasses import replace

import pytest

import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module

pytestmark = pytest.mark.multiprocess

STEPS = 4
LR = 1e-6  # an RL learning rate of large models: few bf16 weights change per step
PLANS = {
    "A": {"actor.generation": (2, 1, (0, 1)), "ref.inference": (2, 1, (0, 1)), "actor.training": (1, 2, (0, 1))},
    "B": {"actor.generation": (1, 2, (1, 0))},
}


def _module(quant=False):
    module = tiny_module(PLANS, gpus=2, batch=8, prompt=5, response=4, algo="grpo", dtype="bf16", hidden=64,
                         reward_model=False)
    if not quant:
        return module
    plans = []
    for plan in module.plans:
        placements = tuple(replace(p, quant="fp8") if str(p.model_stage) == "actor.generation" else p
                           for p in plan.placements)
        plans.append(replace(plan, declared=placements, placements=placements))
    return replace(module, plans=tuple(plans))


def _runs(module, cases):
    out = {}
    for label, (sync, full_every, events) in cases.items():
        spec = TrainSpec("A", STEPS, events, seed=5, rl=RlConfig(algo="grpo", group=2, lr=LR, critic_lr=LR),
                         greedy=True, sync=sync, sync_full_every=full_every)
        result = RlTrainer(module, nr.Runtime(module, "A"), spec).run()
        result.pop("_final_state")
        out[label] = result
    return out


def test_delta_sync_matches_dense_bit_for_bit_and_sends_less():
    cases = {"dense": ("dense", 0, ()), "delta": ("delta", 0, ()), "delta-moved": ("delta", 0, ((2, "B"),)),
             "dense-moved": ("dense", 0, ((2, "B"),)), "every2": ("delta", 2, ())}
    runs = run_world(2, _runs, _module(), cases)
    for a, b in (("dense", "delta"), ("dense", "every2"), ("dense-moved", "delta-moved")):
        assert [s["rollout_sha256"] for s in runs[a]["steps"]] == [s["rollout_sha256"] for s in runs[b]["steps"]]
        assert runs[a]["final_weights_sha256"] == runs[b]["final_weights_sha256"]
    delta = runs["delta"]["steps"]
    assert [s["sync_full"] for s in delta] == [True, False, False, False]
    assert delta[0]["sync_bytes"] == delta[0]["sync_dense_bytes"] > 0
    assert all(s["sync_bytes"] < 0.1 * s["sync_dense_bytes"] for s in delta[1:]), delta
    assert [s["sync_full"] for s in runs["every2"]["steps"]] == [True, False, True, False]
    # after the move to B (after step 2) the generation layout is new: step 3's sync is full
    assert [s["sync_full"] for s in runs["delta-moved"]["steps"]] == [True, False, True, False]


def test_fp8_generation_trains_and_its_sync_sends_about_half():
    runs = run_world(2, _runs, _module(quant=True), {"fp8": ("dense", 0, ((2, "B"),)), "fp8-delta": ("delta", 0, ())})
    dense = run_world(2, _runs, _module(), {"bf16": ("dense", 0, ())})["bf16"]["steps"]
    fp8 = runs["fp8"]["steps"]
    assert all(s["loss"] == s["loss"] and abs(s["loss"]) < 1e3 for s in fp8)
    assert 0.45 < fp8[0]["sync_bytes"] / dense[0]["sync_bytes"] < 0.6, (fp8[0], dense[0])
    assert [s["plan"] for s in fp8] == ["A", "A", "B", "B"]
    assert all(s["sync_bytes"] <= s["sync_dense_bytes"] for s in runs["fp8-delta"]["steps"])
    assert runs["fp8-delta"]["steps"][1]["sync_bytes"] < 0.2 * runs["fp8-delta"]["steps"][1]["sync_dense_bytes"]
