"""The execution plan (what the executor derives from a rank program alone) equals what
the rounds computed per call before it existed, is built once per program object and is
dropped with it; the parking plan from a cached replay picks the units the step-by-step
greedy picks. One process, programs built without the compiler."""

from __future__ import annotations

import gc

import pytest

from nereus.ir.model import Model
from nereus.runtime import execution_plan, streams
from nereus.runtime.parking import _released, park_plan, park_replay, replay
from nereus.runtime.program import rank_program

from runtime_helpers import naive_program, oracle_units, tensor_list

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.training"


def _programs():
    u = lambda dp, tp, pp, gpus: oracle_units(MODEL, STAGE, dp, tp, pp, gpus)  # noqa: E731
    tensors = tensor_list(MODEL, training=True)
    cases = [(u(1, 2, 1, [0, 1]), u(2, 1, 1, [0, 1]), 2, False),  # tp 2 -> dp 2: both ways
             (u(1, 2, 1, [0, 1]), u(1, 4, 1, [0, 1, 2, 3]), 3, True),  # staged
             (u(2, 2, 1, [0, 1, 2, 3]), u(1, 2, 1, [2, 3]), 1, False)]  # destroy, keeps
    for before, after, rounds, staged in cases:
        program = naive_program(before, after, tensors, rounds=rounds, gpus=4, stage_out=staged)
        for gpu in range(4):
            yield rank_program(program, gpu, direct_min_bytes=1024)


def _naive_park_plan(prog, resident, capacity, room):
    """park_plan as the executor computed it on every call before the plan was cached."""
    peaks, final = replay(prog, resident)
    start = resident + sum(i.nbytes for shards in prog.before.values() for i in shards.values())
    staged = {u for w in prog.rounds for u in w.stage_outs}
    held, out = 0, set()
    for index, unit, size in _released(prog):
        later = max(peaks[index + 1:] + [final])
        fits = (capacity is None or later + held + size <= capacity) and \
               (room is None or later - start + held + size <= room)
        if unit in staged or not fits:
            out.add(unit)
        else:
            held += size
    return out


@pytest.mark.parametrize("chunk_bytes", [256, 128 << 20])
def test_the_plan_equals_what_each_round_derived(chunk_bytes):
    for prog in _programs():
        plan = execution_plan.build_plan(prog, chunk_bytes)
        aliases = [a for w in prog.rounds for a in w.aliases]
        assert plan.aliased == {(a.dst_unit, name) for a in aliases for name in a.tensors}
        assert plan.kept == {(a.src_unit, name) for a in aliases for name in a.tensors}
        assert len(plan.rounds) == len(prog.rounds)
        for work, planned in zip(prog.rounds, plan.rounds):
            both = {m.peer for m in work.sends} & {m.peer for m in work.recvs}
            assert planned.both_ways == both
            for messages, flags in ((work.sends, planned.send_in_stream), (work.recvs, planned.recv_in_stream)):
                assert list(flags) == [tuple(streams.streamed(p, m.peer in both, chunk_bytes) for p in m.pieces)
                                       for m in messages]


def test_the_parking_plan_from_the_cached_replay_equals_the_greedy():
    outcomes = set()
    for prog in _programs():
        start = sum(i.nbytes for shards in prog.before.values() for i in shards.values())
        replayed = park_replay(prog, 100)
        for capacity in (None, 0, start // 2, start, start + 100, 2 * start + 100, 10 * start):
            for room in (None, 0, start // 3, start):
                expected = _naive_park_plan(prog, 100, capacity, room)
                assert park_plan(prog, 100, capacity, room, replayed) == expected
                assert park_plan(prog, 100, capacity, room) == expected
                if not any(w.stage_outs for w in prog.rounds) and _released(prog):
                    outcomes.add(bool(expected))
    assert outcomes == {True, False}  # the limits decide: some cases park, some keep


def test_a_plan_is_built_once_per_program_and_dropped_with_it():
    prog = next(iter(_programs()))
    plan = execution_plan.plan_for(prog, 1024)
    assert execution_plan.plan_for(prog, 1024) is plan
    assert execution_plan.plan_for(prog, 2048) is not plan
    assert plan.park_replay(prog, 0) is plan.park_replay(prog, 0)
    key = id(prog)
    assert key in execution_plan._PLANS
    del prog
    gc.collect()
    assert key not in execution_plan._PLANS


def test_the_streams_switches_select_their_own_plan(monkeypatch):
    # variants.py flips these between calls of one process: a plan cut under other switches
    # must not be reused (the chunks would not be what the switches say)
    prog = next(iter(_programs()))
    plan = execution_plan.plan_for(prog, 256)
    single = [c.single for r in plan.rounds for sp in r.recv_streams + r.send_streams for c in sp.chunks]
    assert any(single)
    monkeypatch.setattr(streams, "IN_PLACE", False)
    packed = execution_plan.plan_for(prog, 256)
    assert packed is not plan
    assert not any(c.single for r in packed.rounds for sp in r.recv_streams + r.send_streams for c in sp.chunks)
    monkeypatch.setattr(streams, "IN_PLACE", True)
    assert execution_plan.plan_for(prog, 256) is plan
