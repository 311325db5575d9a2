"""Python's cyclic garbage collector is paused while a transition runs, on 2 gloo ranks.

Why: a full collection scans every tracked object of the process (the runtime's cached
programs, the registered tensors, the user's objects): 0.1-0.4 s on a MoE refit's
rank, a stall that a collective then passes on to every rank. During a transition it
would only find the transition's own short-lived objects, which reference counting frees.

Checked: inside every round the collector is off (`round_hook`); after the call it is
back on, also after a transition that aborts; a collector the user turned off stays off;
with NEREUS_PAUSE_GC=0 (module switch `gc_pause.PAUSE_GC`) it stays on during the call;
the paused transitions move the same bytes as the unpaused ones; the runtime keeps its
compiled parts as JSON text (container objects it cached would be scanned by every later
collection) and `compile` returns an equal, fresh dict each call."""

from __future__ import annotations

import gc

import pytest
import torch

from nereus.runtime import TransitionAborted, gc_pause

from runtime_helpers import registered, spawn_ok
from test_transition_overhead import SOURCE, STAGES  # 2 stages, TP <-> DP both ways

pytestmark = pytest.mark.multiprocess


def _run(rank, world):
    rt, full = registered(SOURCE, "A", STAGES, rank, world, 11, direct_min_bytes=1024)
    seen: list = []

    def hook(index):
        seen.append(gc.isenabled())

    out = {}
    gc.enable()
    cold = rt.transition("B", round_hook=hook)  # cold: compiles and lowers under the pause too
    out["cold"] = (list(seen), gc.isenabled())
    seen.clear()
    warm = rt.transition("A", round_hook=hook)
    out["warm"] = (list(seen), gc.isenabled())
    try:
        rt.transition("B", fault=(1, 0, "commit"))
        out["fault"] = "no error"
    except TransitionAborted:
        out["fault"] = gc.isenabled()
    gc.disable()  # the user's choice is kept
    rt.transition("B")
    out["user_off"] = gc.isenabled()
    gc.enable()
    seen.clear()
    gc_pause.PAUSE_GC = False
    try:
        unpaused = rt.transition("A", round_hook=hook)
    finally:
        gc_pause.PAUSE_GC = True
    out["switch_off"] = (list(seen), gc.isenabled())
    out["bytes"] = [(r.bytes_sent, r.bytes_received) for r in (cold, warm, unpaused)]
    out["intact"] = all(torch.equal(rt.gather_state_dict(ms)[name], t) for ms in STAGES for name, t in full[ms].items())
    # what every later collection would scan: the runtime keeps compiled parts as text
    first, second = rt.compile("B")[0], rt.compile("B")[0]
    out["parts"] = {"texts": all(type(entry[0]) is str for entry in rt._programs.values()),
                    "fresh": first is not second, "equal": first == second and bool(first)}
    return out


@pytest.fixture(scope="module")
def per_rank():
    return spawn_ok(_run, 2)


def test_the_collector_is_off_inside_every_round_and_on_again_after(per_rank):
    for result in per_rank:
        for key in ("cold", "warm"):
            rounds, after = result[key]
            assert rounds and not any(rounds), (key, rounds)
            assert after is True, key


def test_an_aborted_transition_turns_it_back_on(per_rank):
    assert [result["fault"] for result in per_rank] == [True, True]


def test_a_collector_the_user_turned_off_stays_off(per_rank):
    assert [result["user_off"] for result in per_rank] == [False, False]


def test_the_switch_leaves_it_on_and_the_same_bytes_move(per_rank):
    for result in per_rank:
        rounds, after = result["switch_off"]
        assert rounds and all(rounds) and after is True
        (cold, warm, unpaused) = result["bytes"]
        assert warm == unpaused and sum(warm) > 0 and sum(cold) > 0  # the same B -> A, paused or not
        assert result["intact"]


def test_the_runtime_keeps_compiled_parts_as_text(per_rank):
    for result in per_rank:
        assert result["parts"] == {"texts": True, "fresh": True, "equal": True}
