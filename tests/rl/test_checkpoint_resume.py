"""Sharded checkpoints and resume, in process (gloo): a run that saves every 2 steps and
changes plan after step 2 is resumed from its step-2 checkpoint (a) in the plan it was
saved in, bit for bit the uninterrupted run from there on; (b) in another plan and (c) on
one process instead of two, where the state read equals the saved state exactly and
each rank reads exactly the bytes of its new shards."""

import os

import pytest

import nereus.runtime as nr
from nereus.rl.algorithms import RlConfig
from nereus.rl.checkpoint import complete_steps, step_dir
from nereus.rl.checkpoint_read import read_full, stored_tensors
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world, tmpdir
from rl_plans import tiny_module

pytestmark = pytest.mark.multiprocess

S1 = {"actor.generation": (1, 2, (0, 1)), "ref.inference": (2, 1, (0, 1)), "reward.inference": (1, 2, (0, 1)),
      "actor.training": (2, 1, (0, 1)), "critic.training": (1, 2, (0, 1))}
S2 = {**S1, "actor.training": (1, 2, (1, 0)), "actor.generation": (2, 1, (0, 1)), "critic.training": (2, 1, (0, 1))}
ONE = {ms: (1, 1, (0,)) for ms in S1}
PLANS = {"S1": S1, "S2": S2, "ONE": ONE}


def _module():
    return tiny_module(PLANS, gpus=2, batch=8, prompt=5, response=4, hidden=32)


def _train(plan, steps, out, save_every=0, events=(), resume=""):
    module = _module()
    spec = TrainSpec(plan, steps, events, seed=3, rl=RlConfig(algo="ppo"), out=out, save_every=save_every, keep=2,
                     resume=resume)
    result = RlTrainer(module, nr.Runtime(module, plan), spec).run()
    result["_final_state"] = {k: v.numpy() for k, v in result["_final_state"].items()}  # (tensors do not pickle here)
    return result


def _numbers(step):
    return {k: v for k, v in step.items() if k not in ("seconds", "stage_seconds", "reward_seconds", "sync_seconds", "sync_bytes")}


def _two_ranks(out):
    whole = _train("S1", 4, out, save_every=2, events=((2, "S2"),))
    resumed = _train("S2", 4, out + "-r", resume=step_dir(out, 2))
    other = _train("S1", 2, out + "-o", resume=step_dir(out, 2))
    return whole, resumed, other


def test_resume_in_any_plan_and_process_count():
    out = os.path.join(tmpdir(), "run")
    whole, resumed, other = run_world(2, _two_ranks, out)
    assert complete_steps(out) == [2, 4]  # saved every 2 steps (and the last), keep 2
    # (a) the saved plan: bit for bit the uninterrupted run from step 3 on
    assert [s["step"] for s in resumed["steps"]] == [3, 4] and resumed["resumed"]["saved_plan"] == "S2"
    assert [_numbers(s) for s in resumed["steps"]] == [_numbers(s) for s in whole["steps"][2:]]
    assert resumed["final_weights_sha256"] == whole["final_weights_sha256"]
    # (b) another plan: what is read is the saved state, byte for byte, and only the new shards' bytes
    saved, count = read_full(step_dir(out, 2), sorted(stored_tensors(step_dir(out, 2))))
    assert count.data == sum(t.numel() * t.element_size() for t in saved.values())
    by_name = {name.split("/", 1)[1]: t for name, t in saved.items() if name.split("/", 1)[0].endswith(".training")}
    for name, tensor in other["_final_state"].items():
        if "#step" not in name:
            assert (tensor == by_name[name].numpy()).all(), name
    assert other["resumed"]["total_bytes_read"] == other["resumed"]["total_layout_bytes"]
    # (c) one process in plan ONE reads the same state
    one = run_world(1, _train, "ONE", 2, out + "-1", 0, (), step_dir(out, 2))
    assert one["final_weights_sha256"] == other["final_weights_sha256"]
    assert one["resumed"]["bytes_read"] == one["resumed"]["layout_bytes"] == sum(
        t.numel() * t.element_size() for t in saved.values())
