"""Lowering ahead (nereus.runtime.ahead): a thread of each rank lowers the transitions from
the current plan before they are asked for; a transition then takes the lowered part
instead of lowering it, still checked against the proven program's digest; no step runs
beside the main thread's own transition, and a failed or dropped step costs nothing but
the main thread doing the work itself."""

from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager
from typing import Optional

import pytest
import torch

import nereus.ir as ir
from nereus.ir.diagnostics import NereusError, ProgramError
from nereus.runtime import Runtime
from nereus.runtime import distribute, lowerer
from nereus.runtime import ahead as ahead_module
from nereus.runtime import ahead_threads
from nereus.runtime.ahead import Ahead, ahead_mode
from nereus.runtime.program import PartFacts

from runtime_helpers import spawn_ok
from test_rank_parts import SOURCE, STAGES, WORLD, _fulls


class Steps:
    """Fake work: each transition's steps record themselves; `gate` holds step starts."""

    def __init__(self, count: int = 3, fail=(), later: Optional[int] = None, hold_at: Optional[int] = None,
                 fail_at: Optional[int] = None):
        self.log: list = []
        self.closed: list = []
        self.count, self.fail, self.later = count, set(fail), later  # later: the step that yields LATER
        self.fail_at = fail_at  # the step that raises, for every pair
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()
        self.hold_at, self.hold, self.at_hold = hold_at, threading.Event(), threading.Event()  # one step's own gate

    def __call__(self, source, target):
        try:
            for i in range(self.count):
                self.running.set()
                self.gate.wait(30)
                if i == self.hold_at:
                    self.at_hold.set()
                    self.hold.wait(30)
                if (source, target) in self.fail or i == self.fail_at:
                    raise ValueError(f"cannot lower {source} -> {target}")
                self.log.append((source, target, i, threading.current_thread().name))
                self.running.clear()
                yield f"{source}->{target}" if i == 0 else ahead_module.LATER if i == self.later else None
        finally:
            self.closed.append((source, target))


def test_every_transition_from_the_plan_is_lowered_ahead_in_order():
    steps = Steps()
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("A", "C"), ("A", "B")])  # once each
        assert ahead.idle(30)
        assert [s[:3] for s in steps.log] == [("A", t, i) for t in "BC" for i in range(3)]
        assert all(s[3] == "nereus-ahead" for s in steps.log)
        assert ahead.take("A", "C") == "A->C" and ahead.take("A", "B") == "A->B"
        assert ahead.take("A", "B") is None  # taken once
    finally:
        ahead.close()
    assert not ahead.alive


def test_a_pair_at_its_later_step_waits_for_the_other_pairs_first_steps():
    """Every pair's steps up to its LATER (lowering, plan, stream variants) before any
    pair's later ones (replays), those then in the work list's order: the way back of a
    switch made right after construction is ready for its first call before the first
    pair's replays are built, and the first pair's replays come before the others'."""
    steps = Steps(count=4, later=2)
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("B", "A"), ("A", "C")])
        assert ahead.idle(30)
        firsts = [(*k, i) for k in (("A", "B"), ("B", "A"), ("A", "C")) for i in range(3)]
        assert [s[:3] for s in steps.log] == firsts + [("A", "B", 3), ("B", "A", 3), ("A", "C", 3)], steps.log
        assert [ahead.take(*k) for k in (("A", "B"), ("B", "A"), ("A", "C"))] == ["A->B", "B->A", "A->C"]
    finally:
        ahead.close()


def _parked(pairs: list, count: int = 4, release_after: Optional[float] = 0.2, fail_at: Optional[int] = None) -> tuple:
    """An Ahead at work on `pairs` of `count` steps each (the lowering, one, LATER, the
    rest): every pair parked at its LATER, then the first resumed, its step 3 in progress
    and held for `release_after` seconds (None: until `_holding` releases it)."""
    steps = Steps(count=count, later=2, hold_at=3, fail_at=fail_at)
    ahead = Ahead(steps)
    ahead.at_plan(pairs)
    assert steps.at_hold.wait(30)
    if release_after is not None:
        threading.Timer(release_after, steps.hold.set).start()
    return steps, ahead


@contextmanager
def _holding(ahead: Ahead, steps: Steps):
    """ahead.paused() entered while step 3 is held, then the step released: no later step
    of the thread can start first, however slow this thread is."""
    ahead._hold()
    try:
        steps.hold.set()
        ahead._wait_step()
        yield
    finally:
        ahead._release()


def _tail(steps: Steps, start: int) -> list:
    return [x[:3] for x in steps.log[start:]]


def test_a_parked_pair_taken_is_dropped_and_one_no_longer_wanted_waits_until_it_is_again():
    pairs = [("A", "B"), ("A", "C"), ("A", "D"), ("A", "E")]
    steps, ahead = _parked(pairs)
    try:
        with ahead.paused():
            assert _tail(steps, 0) == [(*k, i) for k in pairs for i in range(3)] + [("A", "B", 3)]
            assert ahead.take("A", "C") == "A->C" and ("A", "C") in steps.closed  # parked: later steps dropped
            ahead.at_plan([("A", "E"), ("A", "B")])  # A -> D no longer wanted: kept, parked
            assert ahead.take("A", "B") == "A->B"  # (the pair in progress)
            assert ("A", "D") not in steps.closed and not ahead.idle(0)  # A -> E parked and wanted
        assert ahead.idle(30)  # A -> D, parked and not wanted, is not waited for
        assert _tail(steps, 13) == [("A", "E", 3)], steps.log
        ahead.at_plan([("A", "D"), ("A", "E")])  # wanted again: its later steps resume, not lowered again
        assert ahead.idle(30)
        assert _tail(steps, 14) == [("A", "D", 3)], steps.log
        assert ahead.take("A", "D") == "A->D"
    finally:
        ahead.close()


def test_new_pairs_first_call_work_comes_before_the_replays_and_parked_pairs_follow_the_new_order():
    steps, ahead = _parked([("A", "B"), ("A", "C"), ("A", "D")], count=5)
    try:
        with ahead.paused():  # A -> B is past its LATER: its step 4 waits for the new pair's first-call work
            ahead.at_plan([("A", "D"), ("A", "C"), ("A", "B"), ("A", "E")])
        assert ahead.idle(30)
        assert _tail(steps, 10) == [("A", "E", 0), ("A", "E", 1), ("A", "E", 2), ("A", "D", 3), ("A", "D", 4),
                                    ("A", "C", 3), ("A", "C", 4), ("A", "B", 4), ("A", "E", 3), ("A", "E", 4)], \
            steps.log
    finally:
        ahead.close()


def test_a_pair_whose_replays_are_begun_is_finished_by_the_caller_and_one_not_begun_is_dropped():
    """The thread builds a pair's replays one step at a time; a first call that came with
    some built and not the others would run their streams on the per-call path: take runs
    the rest of a begun pair's later steps in the caller, and leaves a pair parked at its
    LATER (nothing begun) to the call."""
    steps, ahead = _parked([("A", "B"), ("A", "C")], count=6, release_after=None)  # A -> B's step 3 in progress
    try:
        with _holding(ahead, steps):
            assert ahead.take("A", "B") == "A->B"
            assert ahead.take("A", "C") == "A->C"
        assert ("A", "B", 4, "MainThread") in steps.log and ("A", "B", 5, "MainThread") in steps.log, steps.log
        assert not any(x[:2] == ("A", "C") and x[2] > 2 for x in steps.log), steps.log
        assert {("A", "B"), ("A", "C")} <= set(steps.closed)
        # the step log says who ran each step, what it was, and how long it took
        assert [x[:4] for x in ahead.step_log if x[2] == "caller"] == [("A", "B", "caller", "step")] * 2 + \
            [("A", "B", "caller", "end")]
        assert [x[3] for x in ahead.step_log if x[:3] == ("A", "B", "thread")] == ["lowered", "step", "later", "step"]
        assert all(x[5] >= 0 for x in ahead.step_log)
        assert [x[3] for x in ahead.step_log if x[:3] == ("A", "C", "thread")] == ["lowered", "step", "later"]
    finally:
        ahead.close()


def test_a_begun_pair_parked_by_a_new_plan_is_finished_by_the_caller_too():
    steps, ahead = _parked([("A", "B")], count=6, release_after=None)
    try:
        with _holding(ahead, steps):  # A -> B past its LATER, begun: parked while a new pair's first-call work waits
            ahead.at_plan([("A", "B"), ("A", "C")])
            assert ahead.take("A", "B") == "A->B"
        assert [x[2] for x in steps.log if x[:2] == ("A", "B") and x[3] == "MainThread"] == [4, 5], steps.log
    finally:
        ahead.close()


def test_a_step_failing_in_the_caller_is_logged_and_the_lowering_still_taken():
    steps, ahead = _parked([("A", "B")], count=6, release_after=None, fail_at=4)
    try:
        with _holding(ahead, steps):
            assert ahead.take("A", "B") == "A->B"
        assert "cannot lower A -> B" in ahead.failed[("A", "B")]
        assert [x[3] for x in ahead.step_log if x[2] == "caller"] == ["failed"]
    finally:
        ahead.close()


def test_finishing_in_the_caller_stops_after_wait_s():
    steps, ahead = _parked([("A", "B")], count=8, release_after=None)
    try:
        steps.gate.clear()  # the caller's first step waits 0.2 s at the gate (the budget is 0.1 s)
        with _holding(ahead, steps):
            threading.Timer(0.2, steps.gate.set).start()
            started = time.perf_counter()
            assert ahead.take("A", "B", wait_s=0.1) == "A->B"
            assert time.perf_counter() - started < 5
        ran = [x[2] for x in steps.log if x[:2] == ("A", "B") and x[3] == "MainThread"]
        assert ran == [4], steps.log  # one step past the budget, then dropped
    finally:
        ahead.close()


def test_a_parked_pair_is_closed_with_the_thread():
    steps, ahead = _parked([("A", "B"), ("A", "C")])  # A -> B's last step runs; A -> C is parked
    ahead.close()
    assert ("A", "C") in steps.closed and ("A", "C", 3) not in _tail(steps, 0)


def test_no_step_runs_while_paused_and_take_waits_for_the_step_in_progress():
    steps = Steps()
    steps.gate.clear()
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("A", "C")])
        assert steps.running.wait(30)  # A -> B's first step started, held at the gate
        threading.Timer(0.3, steps.gate.set).start()
        started = time.perf_counter()
        with ahead.paused():  # waits for the step in progress
            assert time.perf_counter() - started >= 0.25 and steps.log == [("A", "B", 0, "nereus-ahead")]
            time.sleep(0.3)
            assert len(steps.log) == 1  # nothing ran meanwhile
            assert ahead.take("A", "B") == "A->B"
        assert ahead.idle(30)
        # A -> B was taken: its later steps were dropped (its generator closed); A -> C ran
        assert [s[:3] for s in steps.log[1:]] == [("A", "C", i) for i in range(3)]
        assert ("A", "B") in steps.closed
    finally:
        ahead.close()


def test_a_failed_step_gives_nothing_and_the_next_transition_runs():
    steps = Steps(fail={("A", "B")})
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("A", "C")])
        assert ahead.idle(30)
        assert ahead.take("A", "B") is None and "cannot lower A -> B" in ahead.failed[("A", "B")]
        assert ahead.take("A", "C") == "A->C"
        assert [x[3] for x in ahead.step_log if x[:2] == ("A", "B")] == ["failed"]
        assert [x[3] for x in ahead.step_log if x[:2] == ("A", "C")] == ["lowered", "step", "step", "end"]
    finally:
        ahead.close()


def test_a_new_plan_keeps_what_was_lowered_and_no_pair_is_lowered_twice(monkeypatch):
    steps = Steps(count=2)
    steps.gate.clear()
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("A", "C"), ("B", "A")])
        assert steps.running.wait(30)
        threading.Timer(0.2, steps.gate.set).start()
        with ahead.paused():  # A -> B lowered (its first step), its second not run
            ahead.at_plan([("B", "A"), ("B", "C")])
        assert ahead.idle(30)
        assert ("A", "B") not in steps.closed and ("A", "B", 1) not in [x[:3] for x in steps.log]  # parked
        assert not any(s[:2] == ("A", "C") for s in steps.log)  # never started
        assert ahead.take("B", "A") == "B->A"
        # back in A: A -> B is not lowered again (kept; its later step runs now), A -> C is
        # lowered now, B -> A was taken
        ahead.at_plan([("A", "B"), ("A", "C"), ("B", "A")])
        assert ahead.idle(30)
        assert ("A", "B", 1) in [x[:3] for x in steps.log]
        ahead.at_plan([("B", "A"), ("B", "C")])
        assert ahead.idle(30)
        firsts = [s[:2] for s in steps.log if s[2] == 0]
        assert sorted(firsts) == sorted(set(firsts)) == [("A", "B"), ("A", "C"), ("B", "A"), ("B", "C")], firsts
        assert ahead.take("A", "B") == "A->B" and ahead.take("B", "C") == "B->C"
        # past KEEP_UNWANTED kept pairs the oldest go, and are lowered again when wanted
        monkeypatch.setattr(ahead_module, "KEEP_UNWANTED", 0)
        ahead.at_plan([("C", "A")])  # A -> C (kept, unwanted now) is dropped
        assert ahead.idle(30)
        ahead.at_plan([("A", "C")])
        assert ahead.idle(30)
        assert [s[:2] for s in steps.log if s[2] == 0].count(("A", "C")) == 2
        assert ahead.take("A", "C") == "A->C"
    finally:
        ahead.close()


def test_an_interrupted_pause_leaves_the_thread_running():
    steps = Steps()
    steps.gate.clear()
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B")])
        assert steps.running.wait(30)
        real_wait = ahead._cv.wait

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        ahead._cv.wait = interrupted
        with pytest.raises(KeyboardInterrupt):
            with ahead.paused():
                pass
        ahead._cv.wait = real_wait
        steps.gate.set()
        assert ahead.idle(30) and len(steps.log) == 3  # not left paused
    finally:
        ahead.close()


FORK = """
import os, sys, threading
from nereus.runtime.ahead import Ahead
gate = threading.Event()
running = threading.Event()
def steps(source, target):
    running.set()
    gate.wait(30)
    yield source + target
ahead = Ahead(steps)
ahead.at_plan([("A", "B")])
running.wait(30)
short = sys.getswitchinterval()  # the step's
pid = os.fork()  # while a step runs
if pid == 0:
    import signal
    signal.alarm(20)
    with ahead.paused():
        got = ahead.take("A", "B")
    # no step runs in the child: the interpreter's own switch interval is back
    os._exit(0 if got is None and ahead.idle(1) and sys.getswitchinterval() == 0.005 else 3)
gate.set()
_, status = os.waitpid(pid, 0)
ahead.idle(30)
print("ok" if status == 0 and ahead.take("A", "B") == "AB" and short < 0.005 else f"bad {status} {short}")
ahead.close()
"""


def test_steps_run_on_one_intra_op_thread_and_the_job_keeps_its_own():
    """The thread's torch operators stay on its own core (nereus.runtime.intraop), set
    again at each step (a library's first use on the thread may reset it); the main
    thread's team is not touched."""
    from nereus.runtime import intraop

    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)
    seen = []

    def steps(source, target):
        seen.append(torch.get_num_threads())
        torch.set_num_threads(2)  # the thread's team reset between two steps
        yield source + target
        seen.append(torch.get_num_threads())

    made = []
    worker = threading.Thread(target=lambda: made.append(intraop.one_intraop_thread()))
    worker.start()
    worker.join()
    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B")])
        assert ahead.idle(30) and ahead.take("A", "B") == "AB"
        assert seen == ([1, 1] if made[0] else [max(before, 2), 2])
        assert torch.get_num_threads() == max(before, 2)  # (16 on a 16-core host: seen there, session 20)
    finally:
        ahead.close()
        torch.set_num_threads(before)


def test_steps_run_with_a_short_switch_interval_and_the_old_one_comes_back(monkeypatch):
    """While a step runs (of any runtime's thread) the GIL's switch interval is
    SWITCH_S: the training loop beside it gets the GIL back sooner after each launch."""
    import sys

    seen = []
    gate = threading.Event()

    def steps(source, target):
        seen.append(sys.getswitchinterval())
        gate.wait(30)
        yield source + target
        seen.append(sys.getswitchinterval())

    before = sys.getswitchinterval()
    first, second = Ahead(steps), Ahead(steps)
    try:
        first.at_plan([("A", "B")])
        second.at_plan([("B", "A")])
        for _ in range(300):
            if len(seen) == 2:
                break
            time.sleep(0.01)
        gate.set()
        assert first.idle(30) and second.idle(30)
    finally:
        first.close()
        second.close()
    assert seen == [pytest.approx(ahead_threads.SWITCH_S)] * 4 and sys.getswitchinterval() == before
    monkeypatch.setattr(ahead_threads, "SWITCH_S", 0.0)  # NEREUS_AHEAD_SWITCH_MS=0: left alone
    seen.clear()
    third = Ahead(steps)
    try:
        third.at_plan([("A", "B")])
        assert third.idle(30)
    finally:
        third.close()
    assert seen == [before] * 2


@pytest.mark.parametrize("ms", [0.5, 0.2, 1.1])  # 0.2 and 1.1 do not read back as set (whole microseconds)
def test_the_interval_comes_back_after_a_step_whatever_the_setting(monkeypatch, ms):
    import sys

    monkeypatch.setattr(ahead_threads, "SWITCH_S", ms / 1e3)
    before = sys.getswitchinterval()
    with ahead_threads.short_switch():
        assert sys.getswitchinterval() == pytest.approx(ms / 1e3, abs=1e-6)
    assert sys.getswitchinterval() == before


def test_a_switch_interval_the_job_sets_during_a_step_is_kept():
    import sys

    gate, running = threading.Event(), threading.Event()

    def steps(source, target):
        running.set()
        gate.wait(30)
        yield source + target

    before = sys.getswitchinterval()
    made = Ahead(steps)
    try:
        made.at_plan([("A", "B")])
        assert running.wait(30)
        sys.setswitchinterval(0.02)  # the job's own, while the step runs
        gate.set()
        assert made.idle(30)
        assert sys.getswitchinterval() == pytest.approx(0.02)
    finally:
        made.close()
        sys.setswitchinterval(before)


def test_a_forked_child_does_not_wait_for_the_parents_thread():
    import os
    import subprocess as sp
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = sp.run([sys.executable, "-c", FORK], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "ok", (done.stdout, done.stderr[-2000:])


def test_the_mode_comes_from_the_argument_the_environment_or_the_device(monkeypatch):
    monkeypatch.delenv("NEREUS_LOWER_AHEAD", raising=False)
    assert ahead_mode(None, "cuda") and not ahead_mode(None, "cpu")
    assert ahead_mode("on", "cpu") and not ahead_mode("off", "cuda") and ahead_mode(True, "cpu")
    monkeypatch.setenv("NEREUS_LOWER_AHEAD", "0")
    assert not ahead_mode(None, "cuda")
    monkeypatch.setenv("NEREUS_LOWER_AHEAD", "later")
    with pytest.raises(NereusError, match="unknown lower-ahead mode 'later'"):
        ahead_mode(None, "cpu")


def _in_main_thread(calls: list):
    """distribute._lower_own_part, counting the calls made by the main thread."""
    real = distribute._lower_own_part

    def counted(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            calls.append(args[1:3])
        return real(*args, **kwargs)

    return counted


def _run(rank, world, ahead, corrupt, process=True):
    calls: list = []
    distribute._lower_own_part = _in_main_thread(calls)
    lowerer.ENABLED = process
    rt = Runtime(ir.parse_source(SOURCE, "parts.nir"), "A", rank=rank, world_size=world, ahead=ahead)
    kept = None
    if ahead:
        assert rt._ahead.idle(60)
        # A -> B and the way back are lowered; what is kept holds no parsed JSON dict
        kept = sorted(rt._ahead._done), all(isinstance(v.value[0], PartFacts) for v in rt._ahead._done.values()), \
            sorted({v.where for v in rt._ahead._done.values()})
        if corrupt and rank == 1:  # what the thread lowered is no longer the part it proved
            done = rt._ahead._done[("A", "B")]
            rt._ahead._done[("A", "B")] = type(done)(done.text.replace('"rank":1', '"rank":1 '), done.value,
                                                     done.compiled, done.seconds)
    fulls = _fulls(rt)
    for ms in STAGES:
        rt.register(ms, rt.shard_state_dict(ms, fulls[ms]))
    held = {ms: {n: t.clone() for n, t in rt.state(ms).items()} for ms in STAGES}
    try:
        there = rt.transition("B")
    except ProgramError as error:
        unchanged = rt.plan == "A" and all(torch.equal(held[ms][n], t) for ms in STAGES
                                           for n, t in rt.state(ms).items())
        retry = rt.transition("B")  # lowered in the call this time
        return {"error": error.message, "unchanged": unchanged, "retry_ahead": retry.lowered_ahead,
                "lowered_here": calls}
    if ahead:
        assert rt._ahead.idle(60)  # B -> A lowered ahead after the commit
    back = rt.transition("A")
    # the round trip gives this rank's shards back byte for byte
    exact = all(torch.equal(t, held[ms][n]) for ms in STAGES for n, t in rt.state(ms).items())
    again = rt.transition("B")  # cached: not lowered again, not reported as lowered ahead
    out = {"exact": exact, "lowered_here": calls, "thread": rt._ahead is not None, "kept": kept,
           "reported": (there.lowered_ahead, back.lowered_ahead, again.lowered_ahead)}
    ref = rt._ahead
    rt.close()
    out["closed"] = ref is None or not ref.alive
    return out


def test_transitions_lowered_ahead_are_byte_exact_and_not_lowered_again():
    # by the lowering process; on rank 0, which proves inline here and so keeps the
    # compiled transition, by the thread itself; and with no lowering process, all by the thread
    for process in (True, False):
        for rank, out in enumerate(spawn_ok(_run, WORLD, True, False, process)):
            assert out["exact"] and out["thread"] and out["closed"], out
            assert out["lowered_here"] == [] and out["reported"] == (True, True, False), out  # ahead
            where = ["process"] if process and rank else ["thread"]
            assert out["kept"] == ([("A", "B"), ("B", "A")], True, where), out
    for out in spawn_ok(_run, WORLD, False, False):  # the control: lowered in the call
        assert out["exact"] and not out["thread"] and out["lowered_here"] == [("A", "B"), ("B", "A")], out
        assert out["reported"] == (False, False, False), out


def test_a_part_lowered_ahead_is_still_checked_against_the_proof():
    outs = spawn_ok(_run, WORLD, True, True)
    assert all(out["unchanged"] and out["retry_ahead"] is False and out["lowered_here"] == [("A", "B")]
               for out in outs), outs
    assert "rank 1 refuses its part of the program A -> B" in outs[1]["error"], outs
    assert all("rank 1 refused its part of the program A -> B" in out["error"] for i, out in enumerate(outs)
               if i != 1), outs


def _waits(rank, world):
    rt = Runtime(ir.parse_source(SOURCE, "p.nir"), "A", rank=rank, world_size=world, ahead="on")
    assert rt._ahead.idle(60)
    running = threading.Event()

    def slow(source, target):
        running.set()
        time.sleep(1.0)
        yield None

    rt._ahead._steps = slow
    rt._ahead.at_plan([("A", "B"), ("X", "Y")])  # A -> B is done; a slow step of another pair runs
    assert running.wait(30)
    fulls = _fulls(rt)
    for ms in STAGES:
        rt.register(ms, rt.shard_state_dict(ms, fulls[ms]))
    report = rt.transition("B")
    return report.ahead_wait_s, report.wall_s, report.seconds, report.lowered_ahead


def test_the_wait_for_the_threads_step_is_in_the_report():
    for waited, wall, seconds, taken in spawn_ok(_waits, WORLD):
        assert 0.3 < waited <= wall and waited <= seconds and taken, (waited, wall, seconds, taken)


def _compile_first(rank, world):
    import nereus.runtime.live_parts as live_parts  # where Runtime._lower lowers a part itself

    here: list = []
    real = live_parts.rank_program

    def counted(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            here.append(1)
        return real(*args, **kwargs)

    live_parts.rank_program = counted
    rt = Runtime(ir.parse_source(SOURCE, "p.nir"), "A", rank=rank, world_size=world, ahead="on")
    assert rt._ahead.idle(60)
    part, _ = rt.compile("B")  # the compile takes the thread's part; the transition its work list
    fulls = _fulls(rt)
    for ms in STAGES:
        rt.register(ms, rt.shard_state_dict(ms, fulls[ms]))
    report = rt.transition("B")
    return part["rank"], report.lowered_ahead, len(here)


def test_a_compile_before_the_transition_leaves_the_threads_work_list_to_it():
    assert spawn_ok(_compile_first, WORLD) == [(rank, True, 0) for rank in range(WORLD)]


def _dropped(rank, world):
    rt = Runtime(ir.parse_source(SOURCE, "p.nir"), "A", rank=rank, world_size=world, ahead="on")
    thread = rt._ahead._thread
    del rt
    gc.collect()
    thread.join(30)
    return thread.is_alive()


def test_a_dropped_runtime_ends_its_thread():
    assert spawn_ok(_dropped, WORLD) == [False] * WORLD


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_paused_all_holds_every_runtimes_thread_and_a_weight_sync_pauses_them(order):
    """A transition of one runtime, or a weight sync, must not run beside another
    runtime's step (one GIL): every thread is held before any step in progress is waited
    for (in either order: a thread held only after another's step was waited for would
    go on stepping meanwhile)."""
    from nereus.runtime import vllm_sync

    first, second = Steps(), Steps()
    for s in (first, second):
        s.gate.clear()
    aheads = [Ahead(first), Ahead(second)]
    try:
        aheads[0].at_plan([("A", "B")])
        aheads[1].at_plan([("A", "C")])
        assert first.running.wait(30) and second.running.wait(30)
        threading.Timer(0.2, first.gate.set).start()
        threading.Timer(0.4, second.gate.set).start()
        started = time.perf_counter()
        with ahead_threads.pausing([aheads[i] for i in order]):  # paused_all: every live thread, any order
            assert time.perf_counter() - started >= 0.35  # both steps in progress finished first
            logged = (len(first.log), len(second.log))
            time.sleep(0.3)
            assert (len(first.log), len(second.log)) == logged == (1, 1)  # and no later one started
        seen = []
        sync = object.__new__(vllm_sync.WeightSync)  # the call's wiring alone (no process group)
        sync.is_codec = lambda plan: False  # a dense sync (the test holds no module)
        sync._run = lambda plan, state: seen.append([a._paused for a in aheads]) or "synced"
        assert sync.run("P", {}) == "synced" and seen == [[1, 1]]
        assert all(a.idle(30) for a in aheads) and len(first.log) == len(second.log) == 3
    finally:
        for a in aheads:
            a.close()


def test_a_weight_sync_keeps_the_collector_paused_after_a_steps_own_pause_ends():
    """A step may load a lowering with the collector paused (Lowerer.answer): the sync
    waits for that step first, then pauses the collector itself (the other order found
    it paused, did nothing, and the step's end turned it back on mid-sync)."""
    import gc

    from nereus.runtime import gc_pause, vllm_sync

    inside, release = threading.Event(), threading.Event()

    def steps(source, target):
        with gc_pause.paused():
            inside.set()
            release.wait(30)
        yield source + target

    ahead = Ahead(steps)
    try:
        assert gc.isenabled()
        ahead.at_plan([("A", "B")])
        assert inside.wait(30)
        threading.Timer(0.2, release.set).start()
        seen = []
        sync = object.__new__(vllm_sync.WeightSync)
        sync.is_codec = lambda plan: False  # a dense sync (the test holds no module)
        sync._run = lambda plan, state: seen.append(gc.isenabled())
        sync.run("P", {})
        assert seen == [False] and gc.isenabled()
    finally:
        release.set()
        ahead.close()


def test_paused_all_waits_for_a_closed_threads_last_step_and_not_for_the_calling_step_itself():
    """A closed thread whose step outlived close()'s join is still waited for (that step
    could end a collector pause mid-sync), keeps nothing of it and then leaves _LIVE; a
    step that pauses every thread does not wait for itself."""
    steps = Steps()
    steps.gate.clear()
    stuck = Ahead(steps)
    stuck.at_plan([("A", "B")])
    assert steps.running.wait(30)
    stuck.close(timeout_s=0.1)  # its step is still in progress (the join timed out)
    threading.Timer(0.3, steps.gate.set).start()
    started = time.perf_counter()
    with ahead_module.paused_all():
        assert time.perf_counter() - started >= 0.25
    stuck._thread.join(30)
    assert not stuck._thread.is_alive() and stuck not in ahead_threads._LIVE
    assert ("A", "B") in steps.closed and stuck._current is None and not stuck._later

    def pausing(source, target):  # a step that pauses every thread (its own included)
        with ahead_module.paused_all():
            pass
        yield source + target

    own = Ahead(pausing)
    try:
        own.at_plan([("A", "B")])
        assert own.idle(10)
        with own.paused():
            assert own.take("A", "B") == "AB"
    finally:
        own.close()


def test_a_pair_parked_before_its_later_while_not_wanted_finishes_its_first_call_work_first():
    """Wanted again, a pair whose first-call work was cut short goes before the later
    steps of pairs past their LATER, even of one earlier in the list or in progress."""
    events = {k: (threading.Event(), threading.Event()) for k in (("A", "C", 1), ("A", "B", 4))}  # at, go on
    log = []

    def steps(source, target):  # the lowering, two first-call steps, LATER, two later steps
        for i, value in enumerate((source + target, None, None, ahead_module.LATER, None, None)):
            if (source, target, i) in events:
                at, go_on = events[(source, target, i)]
                at.set()
                go_on.wait(30)
            log.append((source + target, i))
            yield value

    def stop_at(key):
        """Wait for the thread at `key`'s step, let that step end in 0.2 s: pause in the meantime."""
        assert events[key][0].wait(30)
        threading.Timer(0.2, events[key][1].set).start()
        return ahead.paused()

    ahead = Ahead(steps)
    try:
        ahead.at_plan([("A", "B"), ("A", "C")])
        with stop_at(("A", "C", 1)):  # A -> B parked at its LATER, A -> C at its step 1
            ahead.at_plan([("A", "B")])  # A -> C, lowered, parked while not wanted
        with stop_at(("A", "B", 4)):  # A -> B's later steps resumed
            ahead.at_plan([("A", "B"), ("A", "C")])  # A -> C's first-call work goes first
        assert ahead.idle(30)
        assert log[7:] == [("AC", 2), ("AC", 3), ("AB", 5), ("AC", 4), ("AC", 5)], log
    finally:
        for _, go_on in events.values():
            go_on.set()
        ahead.close()
