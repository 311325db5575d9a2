"""Ranks out of step never commit apart, on 2 gloo ranks.

Why: every rank must end a transition in the same plan. Three ways a rank can leave the
others' sequence of control collectives: a `round_hook` (the user's code) raises on one
rank; ranks call `transition` with different targets while both programs are cached
(warm: no compile step compares them); a peer never comes. Before the fix the first let
the other ranks commit while the raising rank stayed in the old plan (its next control
collective paired with their commit), the second returned normally with different plans
on different ranks, and the third raised gloo's raw RuntimeError.

Checked: the hook's error is a TransitionAborted on every rank and a retry succeeds;
different targets give TransitionAborted on every rank naming each rank's transition,
with every rank back in its old plan and its state intact; a peer that does not come
gives TransitionAborted (not gloo's RuntimeError) after the process group's timeout."""

from __future__ import annotations

import time

import pytest
import torch

from nereus.ir import NereusError
from nereus.runtime import Runtime, TransitionAborted

from runtime_helpers import registered, spawn, spawn_ok
from test_transition_overhead import SOURCE, STAGES  # plans A, B over 2 GPUs

pytestmark = pytest.mark.multiprocess

# C: B with the generation replicas' GPUs swapped (another program from A)
PLANS = SOURCE + """
plan C {
  actor.generation  dp 1 tp 2  on 1, 0
  actor.training    dp 2       on 0, 1
}
"""


def _registered(rank, world, timeout_s=60.0):
    return registered(PLANS, "A", STAGES, rank, world, 5, timeout_s=timeout_s)


def _intact(rt, full) -> bool:
    return all(torch.equal(rt.gather_state_dict(ms)[name], t) for ms in STAGES for name, t in full[ms].items())


def _hook_and_targets(rank, world):
    rt, full = _registered(rank, world)
    out = {}

    def hook(index):
        if rank == 1:
            raise RuntimeError("the user's hook failed")

    try:
        rt.transition("B", round_hook=hook)
        out["hook"] = ("returned", rt.plan)
    except TransitionAborted as error:
        out["hook"] = (str(error), rt.plan)
    rt.transition("B")  # the retry, on every rank
    out["retry"] = (rt.plan, _intact(rt, full))
    for plan in ("A", "C", "A"):  # both programs from A cached: the next calls are warm
        rt.transition(plan)
    try:
        rt.transition("B" if rank == 0 else "C")
        out["targets"] = ("returned", rt.plan)
    except TransitionAborted as error:
        out["targets"] = (str(error), rt.plan)
    out["after"] = (_intact(rt, full), [rt.transition("B").target, rt.plan], _intact(rt, full))
    return out


def _cold_and_prepare(rank, world):
    """Different targets on a first (cold) call; prepare on one rank while the other
    transitions; a gather before the holder registered."""
    rt, full = _registered(rank, world)
    out = {}
    try:
        rt.transition("B" if rank == 0 else "C")
        out["cold"] = ("returned", rt.plan)
    except TransitionAborted as error:
        out["cold"] = (str(error), rt.plan)
    began = time.perf_counter()
    try:
        rt.prepare("B") if rank == 0 else rt.transition("B")
        out["prepare"] = ("returned", rt.plan)
    except TransitionAborted as error:
        out["prepare"] = (str(error), rt.plan, time.perf_counter() - began)
    out["after"] = (rt.transition("B").target, _intact(rt, full))
    fresh = Runtime(rt.module, "A", rank=rank, world_size=world, timeout_s=60.0)
    try:
        fresh.gather_state_dict("actor.generation")
        out["gather"] = "returned"
    except NereusError as error:
        out["gather"] = str(error).splitlines()[0]
    return out


def _absent_peer(rank, world, timeout_s):
    rt, full = _registered(rank, world, timeout_s)
    rt.transition("B")
    rt.transition("A")  # A -> B is warm now
    if rank == 1:
        time.sleep(timeout_s + 3)  # never calls
        return None
    began = time.perf_counter()
    try:
        rt.transition("B")
        return ("returned", time.perf_counter() - began)
    except TransitionAborted as error:
        return (str(error), time.perf_counter() - began, rt.plan, [torch.equal(rt.state(ms)[name], t)
                                                                   for ms in STAGES
                                                                   for name, t in rt.shard_state_dict(ms, full[ms]).items()])


@pytest.fixture(scope="module")
def per_rank():
    return spawn_ok(_hook_and_targets, 2)


def test_a_hook_that_raises_on_one_rank_aborts_every_rank(per_rank):
    for result in per_rank:
        text, plan = result["hook"]
        assert "rank 1, round 0, round_hook: RuntimeError: the user's hook failed" in text
        assert plan == "A"
        assert result["retry"] == ("B", True)


def test_different_targets_abort_every_rank_naming_each(per_rank):
    for result in per_rank:
        text, plan = result["targets"]
        assert "rank 0, round -1, control: at the first agreement of A -> B" in text
        assert "rank 1, round -1, control: at the first agreement of A -> C" in text
        assert plan == "A"
        assert result["after"] == (True, ["B", "B"], True)


def test_a_peer_that_never_comes_is_a_transition_aborted():
    timeout_s = 3.0
    results = spawn(_absent_peer, 2, timeout_s)
    assert results[1] == ("ok", None)
    status, result = results[0]
    assert status == "ok", result
    text, seconds, plan, intact = result
    assert "rank 0, round -1, control collective at the first agreement of A -> B" in text
    assert timeout_s - 0.5 < seconds < timeout_s + 10
    assert plan == "A" and all(intact)


def test_cold_targets_prepare_and_gathers_out_of_step_fail_alike_on_every_rank():
    for result in spawn_ok(_cold_and_prepare, 2):
        text, plan = result["cold"]
        assert "rank 0, round -1, control: at compiling A -> B; rank 1, round -1, control: at compiling A -> C" \
            in text and plan == "A"
        text, plan, seconds = result["prepare"]
        assert "rank 0, round -1, control: at prepare('B') from A" in text and plan == "A" and seconds < 30
        assert result["after"] == ("B", True)
        assert result["gather"] == ("error: gather of actor.generation: ranks 0, 1 hold shards of it "
                                    "but did not register them")
