"""The prover process beside rank 0 (nereus.runtime.prover): it gives the digests the
inline proof gives, its errors reach every rank, a part it did not prove is refused, and
a prover that is gone or silent is never waited on: rank 0 proves inline instead."""

from __future__ import annotations

import os
import signal
import time

import pytest

import nereus.ir as ir
from nereus.backends import proof
from nereus.ir.diagnostics import NereusError
from nereus.passes import compile_transition
from nereus.runtime import Runtime
from nereus.runtime.prover import Prover, prover_mode

from runtime_helpers import spawn, spawn_ok
from test_rank_parts import SOURCE, WORLD, _exact, _to_b

# plan B on other GPUs: the program A -> B of this module is not the one of SOURCE
OTHER = SOURCE.replace("plan B { actor.generation dp 1 tp 2 on 1, 2", "plan B { actor.generation dp 1 tp 2 on 0, 2")


def test_the_process_gives_the_digests_of_the_inline_proof():
    module = ir.parse_source(SOURCE, "p.nir")
    prover = Prover(module)
    try:
        tickets = [prover.request("A", "B", WORLD), prover.request("B", "A", WORLD + 1)]
        # answers are collected by ticket, in any order
        back, there = prover.result(tickets[1], 60.0), prover.result(tickets[0], 60.0)
    finally:
        prover.close()
    for got, (source, target, world) in ((there, ("A", "B", WORLD)), (back, ("B", "A", WORLD + 1))):
        _, digests = proof.prove(compile_transition(module, source, target), module, world)
        assert got[0] == "ok" and got[1] == digests and len(digests) == world and got[2] > 0 and not got[3]


def test_the_transitions_from_the_current_plan_are_proven_ahead():
    module = ir.parse_source(SOURCE, "p.nir")
    prover = Prover(module)
    try:
        prover.at_plan("B", WORLD)
        time.sleep(3.0)  # a proof of this module takes ~0.05 s
        got = prover.result(prover.request("B", "A", WORLD), 60.0)
        back = prover.result(prover.request("A", "B", WORLD), 60.0)  # the way back to B: ahead too
        other = prover.result(prover.request("B", "A", WORLD + 1), 60.0)  # another world: not ahead
    finally:
        prover.close()
    _, digests = proof.prove(compile_transition(module, "B", "A"), module, WORLD)
    assert got[0] == "ok" and got[1] == digests and got[3] is True
    assert back[0] == "ok" and back[3] is True
    assert other[0] == "ok" and len(other[1]) == WORLD + 1 and other[3] is False


def test_a_compile_error_comes_back_as_the_error():
    prover = Prover(ir.parse_source(SOURCE, "p.nir"))
    try:
        got = prover.result(prover.request("A", "Z", WORLD), 60.0)
    finally:
        prover.close()
    assert got[0] == "error" and isinstance(got[1], NereusError) and "Z" in got[1].message


def test_a_prover_gone_or_silent_is_not_waited_on():
    module = ir.parse_source(SOURCE, "p.nir")
    gone = Prover(module)
    gone._ends.process.kill()
    gone._ends.process.wait()
    ticket = gone.request("A", "B", WORLD)  # None: it is known gone; or the answer never comes
    assert gone.result(ticket, 60.0) is None and not gone.alive
    assert gone.request("A", "B", WORLD) is None
    silent = Prover(module)
    os.kill(silent._ends.process.pid, signal.SIGSTOP)
    started = time.perf_counter()
    assert silent.result(silent.request("A", "B", WORLD), 0.5) is None
    assert time.perf_counter() - started < 5.0 and not silent.alive  # and the process is ended


def test_the_mode_comes_from_the_argument_the_environment_or_the_device(monkeypatch):
    monkeypatch.delenv("NEREUS_PROVER", raising=False)
    assert prover_mode(None, "cuda") == "process" and prover_mode(None, "cpu") == "inline"
    assert prover_mode("process", "cpu") == "process" and prover_mode("inline", "cuda") == "inline"
    monkeypatch.setenv("NEREUS_PROVER", "inline")
    assert prover_mode(None, "cuda") == "inline"
    monkeypatch.setenv("NEREUS_PROVER", "threads")
    with pytest.raises(NereusError, match="unknown prover mode 'threads'"):
        prover_mode(None, "cpu")


def _run(rank, world, child_source, kill):
    module = ir.parse_source(SOURCE, "parts.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world, prover="process")
    assert (rt._prover is not None) == (rank == 0)
    if rank == 0 and child_source is not None:  # the prover holds another module
        rt._prover.close()
        rt._prover = Prover(ir.parse_source(child_source, "child.nir"))
    fulls, report = _to_b(rt, NereusError)
    if isinstance(report, dict):
        return report
    exact_b = _exact(rt, fulls)
    proved_aside = rank > 0 or rt._prover.alive
    if rank == 0 and kill:  # the way back is proven inline
        rt._prover._ends.process.kill()
    back = rt.transition("A")
    exact_a = _exact(rt, fulls)
    return {"exact": exact_b and exact_a, "proofs_s": (report.verify_program_s, back.verify_program_s),
            "aside": proved_aside, "gone": rank > 0 or not rt._prover.alive}


def test_transitions_proven_by_the_process_or_inline_once_it_is_gone_are_byte_exact():
    for out in spawn_ok(_run, WORLD, None, True):
        assert out["exact"] and out["aside"] and out["gone"] and min(out["proofs_s"]) > 0


def test_a_part_the_process_did_not_prove_is_refused_on_every_rank():
    # the prover's A -> B is another program: every rank's digest differs from its verdict
    for rank, out in enumerate(spawn_ok(_run, WORLD, OTHER, False)):
        assert out["unchanged"], out
        assert f"rank {rank} refuses its part of the program A -> B" in out["error"] or \
            "refused its part of the program A -> B" in out["error"], out


def test_the_processs_error_is_every_ranks_error():
    broken = SOURCE.replace("plan B {", "plan C {")  # the prover knows no plan B
    outs = spawn_ok(_run, WORLD, broken, False)
    assert all(out["unchanged"] and out["error"] == "no plan named 'B'" for out in outs), outs


def _children() -> set:
    """Pids of this process's live prover children."""
    import subprocess as sp

    out = sp.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True,
                 text=True).stdout  # (-ww: the whole command line, whatever COLUMNS says)
    return {int(line.split()[0]) for line in out.splitlines() if "nereus.backends.proof" in line and "<defunct>" not in line}


def _constructor_raises(rank, world):
    before = _children()
    try:
        Runtime(ir.parse_source(SOURCE, "p.nir"), "A", rank=rank, world_size=world, prover="process")
    except NereusError as error:  # the plans use 3 GPUs, the group has 1
        return str(error), _children() == before
    return None, _children() == before


def test_a_dropped_prover_or_runtime_leaves_no_process():
    import gc

    before = _children()
    for _ in range(3):
        prover = Prover(ir.parse_source(SOURCE, "p.nir"))
        assert prover.alive and _children() - before  # (seen: the check below can fail)
        del prover
        gc.collect()
    # none of the three is left (a prover of an earlier test in this process, collected by
    # this gc.collect, may be gone from `before` too: seen in the suite with files per worker)
    assert not _children() - before
    # a Runtime whose constructor raises starts none (its checks run before the process)
    (status, (error, none_left)), = spawn(_constructor_raises, 1)
    assert status == "ok" and error and none_left


def test_the_prover_finds_nereus_where_this_process_did(tmp_path, monkeypatch):
    import pathlib
    import sys

    shadow = tmp_path / "nereus"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('a nereus of the working directory')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", sys.path + [pathlib.Path(tmp_path / "elsewhere")])  # a PathLike entry
    prover = Prover(ir.parse_source(SOURCE, "p.nir"))
    try:
        got = prover.result(prover.request("A", "B", WORLD), 60.0)
    finally:
        prover.close()
    assert got is not None and got[0] == "ok"


def test_a_forgotten_ticket_is_dropped_and_an_error_is_proven_again():
    prover = Prover(ir.parse_source(SOURCE, "p.nir"))
    try:
        first = prover.request("A", "B", WORLD)
        prover.forget(first)
        second = prover.request("A", "Z", WORLD)
        assert prover.result(second, 60.0)[0] == "error" and prover._answers == {}
        assert prover.result(first, 60.0) is None  # forgotten: nothing to collect
        again = prover.result(prover.request("A", "Z", WORLD), 60.0)
        assert again[0] == "error" and again[2] is False  # proven again, not the kept error
    finally:
        prover.close()


def _compile_with_a_stopped_prover(rank, world):
    rt = Runtime(ir.parse_source(SOURCE, "p.nir"), "A", rank=rank, world_size=world, prover="process",
                 timeout_s=6.0)
    if rank == 0:
        os.kill(rt._prover._ends.process.pid, signal.SIGSTOP)
    started = time.perf_counter()
    part, _ = rt.compile("B")
    return part["rank"], time.perf_counter() - started, rank > 0 or not rt._prover.alive


def test_a_stopped_prover_is_given_up_in_time_for_every_rank():
    # rank 0 waits half of timeout_s, then proves inline; the others wait timeout_s
    for rank, (part_rank, seconds, given_up) in enumerate(spawn_ok(_compile_with_a_stopped_prover, WORLD)):
        assert part_rank == rank and seconds < 6.0 and given_up


FORK = """
import os, sys, warnings
warnings.simplefilter("default")
import nereus.ir as ir
from nereus.runtime.prover import Prover
from test_rank_parts import SOURCE
prover = Prover(ir.parse_source(SOURCE, "p.nir"))
pid = os.fork()
if pid == 0:  # a forked worker that ends normally: it must neither stop nor wait on the prover
    sys.exit(0)
os.waitpid(pid, 0)
got = prover.result(prover.request("A", "B", 3), 60.0)
print("ok" if got and got[0] == "ok" and prover.alive else f"bad {got}")
"""


def test_a_forked_child_leaves_the_prover_alone():
    import subprocess as sp
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.join(here, "..", ".."),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = sp.run([sys.executable, "-c", FORK], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "Error" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]


def test_helpers_share_one_fork_hook(monkeypatch):
    """A fork hook cannot be removed: one per helper process would outlive its helper
    (a job building a Runtime per step would pile them up)."""
    from nereus.runtime import child
    from nereus.runtime.lowerer import Lowerer

    registered = []
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: registered.append(hook))
    made = [Prover(ir.parse_source(SOURCE, "p.nir")), Lowerer(ir.parse_source(SOURCE, "p.nir"), 1, 1 << 20)]
    try:
        assert registered == [] and all(m._ends in child._LIVE for m in made)
    finally:
        for m in made:
            m.close()
