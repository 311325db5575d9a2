"""nereus.runtime.intraop: one intra-op thread for the calling thread, no other thread's."""

import sys
import threading

import pytest
import torch

from nereus.runtime import intraop

needs_openmp = pytest.mark.skipif(not (intraop.openmp_backend() and sys.platform.startswith("linux")),
                                  reason="torch's parallel backend here is not OpenMP on Linux")


def _in_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    if before < 2:  # (a one-core machine: a team of 2 still tells one thread from the others)
        torch.set_num_threads(2)
    yield torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(before)


@needs_openmp
def test_only_the_calling_thread_gets_one(two_threads):
    def ahead():
        made = intraop.one_intraop_thread()
        x = torch.arange(1 << 18, dtype=torch.int64)
        return made, torch.get_num_threads(), int((x * 3).sum())

    made, inside, total = _in_thread(ahead)
    assert made and inside == 1
    assert total == 3 * ((1 << 18) * ((1 << 18) - 1) // 2)  # operators still right on one thread
    assert torch.get_num_threads() == two_threads  # the caller's own team
    assert _in_thread(torch.get_num_threads) == two_threads  # and the team of a thread started later


@needs_openmp
def test_a_thread_that_ran_operators_first(two_threads):
    def ahead():
        torch.ones(1 << 16).sum()  # torch's per-thread setup already done
        return intraop.one_intraop_thread(), torch.get_num_threads()

    assert _in_thread(ahead) == (True, 1)
    assert torch.get_num_threads() == two_threads


@needs_openmp
def test_a_runtime_that_does_not_answer_is_passed_over(monkeypatch, two_threads):
    """Another package's copy of the OpenMP runtime mapped first: its setting does not
    reach torch's operators, the next candidate's does, and that one is kept."""
    tried = []
    real = intraop._setters

    def setters():
        yield lambda n: tried.append(("other copy", n))
        yield from real()

    monkeypatch.setattr(intraop, "_setters", setters)
    monkeypatch.setattr(intraop, "_found", {})
    assert _in_thread(lambda: (intraop.one_intraop_thread(), torch.get_num_threads())) == (True, 1)
    assert tried == [("other copy", 1)] and intraop._found["setter"] is not None
    assert _in_thread(lambda: (intraop.one_intraop_thread(), torch.get_num_threads())) == (True, 1)
    assert tried == [("other copy", 1)]  # the kept one, straight away


def test_without_a_runtime_nothing_changes(monkeypatch, two_threads):
    monkeypatch.setattr(intraop, "_found", {"setter": None})
    assert _in_thread(lambda: (intraop.one_intraop_thread(), torch.get_num_threads())) == (False, two_threads)
