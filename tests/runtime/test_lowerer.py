"""The lowering process (nereus.runtime.lowerer): it lowers a rank's part of a transition
off the training process's GIL and sends back exactly what the thread would have made; a
process that fails, ends or goes silent only means the thread lowers itself; the thread
waits for it in short steps (WAITING), and a transition that takes a pair the process is
still lowering waits for it in the caller instead of lowering again."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import nereus.ir as ir
from nereus.runtime import ahead as ahead_module
from nereus.runtime import child, distribute, lowerer
from nereus.runtime.ahead import WAITING, Ahead
from nereus.runtime.lowerer import Lowerer, lower

from test_rank_parts import SOURCE

MODULE = ir.parse_source(SOURCE, "parts.nir")


@pytest.fixture
def process():
    made = Lowerer(MODULE, 1, 1 << 20)
    yield made
    made.close()


def _answer(made, ticket, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = made.answer(ticket, 1.0)
        if got is not None:
            return got
    raise AssertionError("no answer")


def test_the_process_lowers_what_the_thread_would(process):
    for source, target in (("A", "B"), ("B", "A")):
        kind, got = _answer(process, process.request(source, target))
        here = lower(MODULE, 1, 1 << 20, source, target)
        assert kind == "ok" and got.text == here.text and got.facts == here.facts and got.program == here.program
        # and what the thread makes without the process
        assert (got.facts, got.program) == ahead_module.lower_part(here.text, 1, 1 << 20)
    assert process.alive


def test_the_process_imports_no_torch(tmp_path):
    """It starts in a few tenths of a second (torch would take seconds)."""
    (tmp_path / "p.nir").write_text(SOURCE)
    code = ("import sys, nereus.ir as ir\n"
            "from nereus.runtime.lowerer import lower, serve\n"
            f"lower(ir.parse_file({str(tmp_path / 'p.nir')!r}), 1, 1 << 20, 'A', 'B')\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.join(here, "..", "..")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_lowering_that_fails_there_is_an_error_with_its_message(process):
    kind, why = _answer(process, process.request("A", "Z"))
    with pytest.raises(Exception) as raised:
        lower(MODULE, 1, 1 << 20, "A", "Z")
    assert kind == "error" and why == f"{type(raised.value).__name__}: {raised.value}"
    assert process.alive  # the next one is lowered there again
    assert _answer(process, process.request("A", "B"))[0] == "ok"


def test_a_process_that_ended_or_went_silent_is_failed(process, monkeypatch, caplog):
    process._ends.process.kill()
    process._ends.process.wait()
    assert process.request("A", "B") is None or _answer(process, 0)[0] == "gone"
    assert not process.alive and process.request("A", "B") is None

    monkeypatch.setattr(lowerer, "TIMEOUT_S", 1.0)
    silent = Lowerer(MODULE, 1, 1 << 20)
    try:
        os.kill(silent._ends.process.pid, signal.SIGSTOP)
        ticket = silent.request("A", "B")
        started = time.monotonic()
        assert silent.answer(ticket, 0.1) is None  # not in yet
        with caplog.at_level(logging.WARNING, logger="nereus.ahead"):
            assert _answer(silent, ticket) == ("gone", "silent for 1 s")
        assert time.monotonic() - started < 10 and not silent.alive
        assert "lowering process silent for 1 s; lowering here" in caplog.text
    finally:
        silent.close()


def test_a_process_that_does_not_start_leaves_the_thread_to_lower(monkeypatch, caplog):
    def refuse(serve, ends):
        raise OSError("no more processes")

    monkeypatch.setattr(child, "start", refuse)
    with caplog.at_level(logging.WARNING, logger="nereus.ahead"):
        made = Lowerer(MODULE, 1, 1 << 20)
    assert not made.alive and made.request("A", "B") is None
    assert "lowering process did not start (OSError: no more processes); lowering here" in caplog.text


def test_the_thread_waits_for_the_process_in_short_steps_and_a_take_waits_in_the_caller(process):
    """steps() yields WAITING while the process lowers; a take() of that pair meanwhile
    runs it to its lowering in the caller (no lowering in this process either way)."""
    calls = []  # lowerings in this process (the thread's own go through distribute)
    own = distribute._lower_own_part
    distribute._lower_own_part = lambda *a, **k: calls.append(a[1:3]) or own(*a, **k)
    gate = threading.Event()
    real_answer = process.answer

    def held(ticket, timeout_s):  # the process's answer comes in only once the gate opens
        if not gate.is_set():
            time.sleep(timeout_s)
            return None
        return real_answer(ticket, timeout_s)

    process.answer = held
    made = Ahead(lambda s, t: ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, s, t))
    try:
        made.at_plan([("A", "B")])
        time.sleep(0.5)  # several WAITING steps
        assert ("A", "B") not in made._done and made._current[2] is False
        threading.Timer(0.5, gate.set).start()
        with made.paused():
            started = time.monotonic()
            taken = made.take("A", "B")
        assert taken is not None and taken.where == "process" and time.monotonic() - started >= 0.3
        assert calls == []  # nothing lowered in this process
    finally:
        made.close()
        distribute._lower_own_part = own
    assert taken.text == lower(MODULE, 1, 1 << 20, "A", "B").text


def test_without_the_process_the_steps_lower_in_the_thread(process):
    process._ends.process.kill()
    process._ends.process.wait()
    steps = ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, "A", "B")
    first = next(steps)
    assert first is not WAITING and first.where == "thread"
    assert first.text == lower(MODULE, 1, 1 << 20, "A", "B").text


def _held_first_call(rank, world):
    """A first transition right after construction, while the lowering process is (held)
    still at it: it waits for it, reported in ahead_wait_s, instead of lowering again."""
    from nereus.runtime import Runtime
    from test_rank_parts import STAGES, _fulls

    rt = Runtime(MODULE, "A", rank=rank, world_size=world, ahead="on")
    if rt._lowerer is not None:
        real, opens = rt._lowerer.answer, time.monotonic() + 1.5

        def held(ticket, timeout_s):
            if time.monotonic() < opens:
                time.sleep(min(timeout_s, max(0.0, opens - time.monotonic())))
                return None
            return real(ticket, timeout_s)

        rt._lowerer.answer = held
    fulls = _fulls(rt)
    for ms in STAGES:
        rt.register(ms, rt.shard_state_dict(ms, fulls[ms]))
    report = rt.transition("B")
    out = (rt._lowerer is not None, report.lowered_ahead, report.ahead_wait_s, report.wall_s)
    rt.close()
    return out


def test_a_first_call_waits_for_the_process_and_reports_the_wait():
    from runtime_helpers import spawn_ok
    from test_rank_parts import WORLD

    for rank, (has, ahead, waited, wall) in enumerate(spawn_ok(_held_first_call, WORLD)):
        assert has == (rank != 0) and ahead, (rank, has, ahead)  # rank 0 proves inline: no process
        if has:
            assert 0.3 < waited <= wall, (rank, waited, wall)


def test_a_pair_dropped_while_the_process_lowers_it_leaves_nothing_kept(process):
    os.kill(process._ends.process.pid, signal.SIGSTOP)  # no answer before the drop
    steps = ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, "A", "B")
    assert next(steps) is WAITING  # asked, not answered yet
    steps.close()  # dropped (at_plan, close)
    assert process._wanted == set()
    os.kill(process._ends.process.pid, signal.SIGCONT)
    kind, got = _answer(process, process.request("B", "A"))  # the dropped answer comes first
    assert kind == "ok" and '"from":"B"' in got.text and process._answers == {} and process._wanted == set()


def test_a_pair_asked_again_while_the_process_is_at_it_is_lowered_once(process):
    os.kill(process._ends.process.pid, signal.SIGSTOP)
    first = process.request("A", "B")
    process.forget(first)  # dropped, then wanted again before its answer came
    again = process.request("A", "B")
    os.kill(process._ends.process.pid, signal.SIGCONT)
    assert again == first
    assert _answer(process, again)[0] == "ok" and process._pairs == {}


def test_an_error_there_leaves_the_lowering_to_the_transition(process):
    """The thread's step fails (not lowered again in the thread), and a take() returns
    None at once: the transition lowers it once, and raises its error."""
    calls = []
    own = distribute._lower_own_part
    distribute._lower_own_part = lambda *a, **k: calls.append(a[1:3]) or own(*a, **k)
    try:
        steps = ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, "A", "Z")
        with pytest.raises(ahead_module.LoweringFailed, match="could not lower A -> Z: "):
            while next(steps) is WAITING:
                pass
        assert calls == []
    finally:
        distribute._lower_own_part = own


def test_a_take_waits_for_the_process_at_most_wait_s_and_at_plan_is_not_starved(process):
    os.kill(process._ends.process.pid, signal.SIGSTOP)  # the process never answers here
    made = Ahead(lambda s, t: ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, s, t))
    try:
        made.at_plan([("A", "B"), ("B", "A")])
        time.sleep(0.3)  # WAITING steps one after another
        started = time.monotonic()
        made.at_plan([("A", "B"), ("B", "A")])  # the lock, between two steps
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        with made.paused():
            assert made.take("A", "B", wait_s=0.5) is None
        assert 0.4 < time.monotonic() - started < 3.0
        assert made._current is None or made._current[0] != ("A", "B")
        assert ("A", "B") not in {k for k, t in process._pairs.items() if t in process._wanted}  # forgotten
    finally:
        made.close()
        os.kill(process._ends.process.pid, signal.SIGCONT)


def test_an_answer_read_before_it_was_asked_for_is_not_lowered_again(process):
    """expect() asks for the work list ahead: an answer read while the thread waited for
    another is kept for the request of its pair, which takes its ticket back (the process,
    stopped now, lowers nothing more)."""
    process.expect([("A", "B"), ("B", "A")])
    first = dict(process._expected)
    assert process.asked("A", "B") and process.asked("B", "A")
    assert _answer(process, first[("B", "A")])[0] == "ok"  # A -> B's answer comes first: read and kept
    os.kill(process._ends.process.pid, signal.SIGSTOP)
    try:
        assert process.request("A", "B") == first[("A", "B")]
        kind, got = process.answer(first[("A", "B")], 0.0)
        assert kind == "ok" and '"from":"A"' in got.text
        assert process._pairs == {} and process._answers == {} and not process.asked("A", "B")
    finally:
        os.kill(process._ends.process.pid, signal.SIGCONT)


def test_a_pair_no_longer_expected_is_forgotten(process):
    os.kill(process._ends.process.pid, signal.SIGSTOP)
    process.expect([("A", "B"), ("B", "A")])
    process.expect([("B", "A")])  # A -> B was compiled meanwhile
    assert not process.asked("A", "B") and process.asked("B", "A")
    os.kill(process._ends.process.pid, signal.SIGCONT)
    ticket = process._expected[("B", "A")]
    assert _answer(process, ticket)[0] == "ok"  # A -> B's answer read past, not kept
    assert process._answers == {} and process._pairs == {} and process._wanted == set()


def test_the_work_list_is_asked_for_at_once_and_a_take_of_a_pair_not_started_waits_for_it(process):
    """The thread is at A -> B (held: its answer never reaches it) when a transition takes
    B -> A: the process was asked for it with the work list, so the caller waits for its
    answer instead of lowering it again in this process."""
    calls = []
    own = distribute._lower_own_part
    distribute._lower_own_part = lambda *a, **k: calls.append(a[1:3]) or own(*a, **k)
    real_answer = process.answer

    def held(ticket, timeout_s):  # A -> B's answer never reaches the thread
        if ticket == process._expected.get(("A", "B")):
            time.sleep(timeout_s)
            return None
        return real_answer(ticket, timeout_s)

    process.answer = held
    made = Ahead(lambda s, t: ahead_module.steps(MODULE, 1, "cpu", 1 << 20, False, process, s, t),
                 lowerer=process)
    try:
        made.at_plan([("A", "B"), ("B", "A")])
        assert process.asked("A", "B") and process.asked("B", "A")
        end = time.monotonic() + 30
        while (made._current is None or made._current[0] != ("A", "B")) and time.monotonic() < end:
            time.sleep(0.01)
        assert made._current[0] == ("A", "B") and ("B", "A") in made._queue
        with made.paused():
            taken = made.take("B", "A", wait_s=60.0)
        assert taken is not None and taken.where == "process" and '"from":"B"' in taken.text
        assert calls == [] and ("B", "A") not in made._queue
    finally:
        made.close()
        distribute._lower_own_part = own


def test_silence_counts_from_a_request_to_an_idle_process_with_answers_not_collected(process):
    process.expect([("A", "B"), ("B", "A")])
    assert _answer(process, process._expected[("B", "A")])[0] == "ok"  # A -> B's is in, not collected
    process._heard -= 10 * lowerer.TIMEOUT_S  # its last answer long ago; idle since
    kind, _ = _answer(process, process.request("B", "A"))  # (collected: asked again)
    assert kind == "ok" and process.alive


def _started_before_the_groups(rank, world):
    """Whether this rank's lowering process was running, and asked for A -> B, when the
    constructor came to Triton's import (after the groups): it starts first."""
    from nereus.runtime import Runtime
    from nereus.runtime import runtime as runtime_module

    made, seen = [], []

    class Recorded(Lowerer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    real = runtime_module.replay.packer_for
    lowerer.Lowerer = Recorded
    runtime_module.replay.packer_for = lambda device: seen.append([(m.alive, m.asked("A", "B")) for m in made]) \
        or real(device)
    try:
        rt = Runtime(MODULE, "A", rank=rank, world_size=world, ahead="on", verify_programs=False)
    finally:
        lowerer.Lowerer = Lowerer
        runtime_module.replay.packer_for = real
    rt.close()
    return seen


def test_the_process_starts_first_and_is_asked_for_the_work_list_at_once():
    from runtime_helpers import spawn_ok
    from test_rank_parts import WORLD

    assert spawn_ok(_started_before_the_groups, WORLD) == [[[(True, True)]]] * WORLD


def _lowering_processes() -> set:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True,
                         text=True).stdout  # (-ww: the whole command line, whatever COLUMNS says)
    return {int(line.split()[0]) for line in out.splitlines()
            if "nereus.runtime.lowerer" in line and "<defunct>" not in line}


def _constructor_raises(rank, world):
    """The constructor starts the lowering process first, then finds the plans need 3 GPUs."""
    from nereus.runtime import Runtime

    made = []

    class Recorded(Lowerer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.alive and self._ends.process.pid in _lowering_processes())  # (ps sees it)

    before = _lowering_processes()
    lowerer.Lowerer = Recorded
    try:
        Runtime(MODULE, "A", rank=rank, world_size=world, ahead="on", verify_programs=False)
    except ir.NereusError as error:  # the plans use 3 GPUs, the group has 1
        return error.message, made, _lowering_processes() == before
    finally:
        lowerer.Lowerer = Lowerer
    return None, made, _lowering_processes() == before


def test_a_constructor_that_raises_leaves_no_lowering_process():
    from runtime_helpers import spawn_ok

    (error, made, none_left), = spawn_ok(_constructor_raises, 1)
    assert error is not None and "only 1 ranks run" in error and made == [True] and none_left, (error, made)


def test_a_request_forgotten_before_the_process_started_it_is_not_lowered(process):
    """The process reads every message that came before it starts a lowering: one the
    runtime no longer wants (a commit changed the work list) is dropped, not lowered
    ahead of the pair a transition waits for."""
    os.kill(process._ends.process.pid, signal.SIGSTOP)
    process.expect([("A", "B"), ("B", "A")])
    process.expect([("B", "A")])
    dropped = process._forgotten[("A", "B")]
    os.kill(process._ends.process.pid, signal.SIGCONT)
    assert _answer(process, process._expected[("B", "A")])[0] == "ok"
    # A -> B never answered (its arrival would have been read past before B -> A's)
    assert process._forgotten == {("A", "B"): dropped} and process._answers == {}
    assert process.request("A", "B") == dropped  # asked again: lowered now
    kind, got = _answer(process, dropped)
    assert kind == "ok" and '"from":"A"' in got.text and process._forgotten == {} and process._pairs == {}


def test_an_answer_in_outlives_its_process(process):
    process.expect([("A", "B"), ("B", "A")])
    assert _answer(process, process._expected[("B", "A")])[0] == "ok"  # A -> B's read ahead
    process._ends.process.kill()
    process._ends.process.wait()
    assert process.asked("A", "B") and not process.asked("B", "A")
    ticket = process.request("A", "B")
    assert ticket is not None and process.answer(ticket, 0.0)[0] == "ok"
    assert process.request("B", "A") is None  # gone: the thread lowers it
    process.expect([("A", "Z")])
    process.expect([])
    assert process._answers == {} and process._pairs == {} and process._wanted == set()


def test_answers_in_outlive_a_process_that_dies_while_another_is_awaited(process):
    process.expect([("A", "B"), ("B", "A")])
    assert _answer(process, process._expected[("B", "A")])[0] == "ok"  # A -> B's read ahead
    os.kill(process._ends.process.pid, signal.SIGSTOP)
    waited = process.request("A", "Z")
    os.kill(process._ends.process.pid, signal.SIGKILL)
    assert _answer(process, waited)[0] == "gone" and not process.alive
    ticket = process.request("A", "B")  # still served, from what came in before
    assert ticket is not None and process.answer(ticket, 0.0)[0] == "ok"
    assert process._answers == {} and process._pairs == {} and process._wanted == set()
