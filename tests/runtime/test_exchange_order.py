"""The order of a stream exchange's host steps (nereus.runtime.streams.exchange), one
process with torch.distributed's posting replaced by a recorder: a round's same-GPU
copies are queued once the first batch is posted; a chunk into host memory is finished
only after its device->host copy is done, in chunk order, and a failing one is reported,
never raised (a raise would leave the peers waiting on posts that never come)."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime import streams


@pytest.fixture
def posted(monkeypatch):
    calls = []
    monkeypatch.setattr(streams.dist, "batch_isend_irecv", lambda ops: calls.append(("batch", len(ops))) or [])
    monkeypatch.setattr(streams.dist, "P2POp", lambda *args: args)
    return calls


def test_a_rounds_copies_are_queued_after_the_first_batch_is_posted(posted):
    calls = posted
    views = [torch.arange(64, dtype=torch.float32) for _ in range(3)]
    out = streams.PeerStream(1, views, "cpu", chunk_bytes=128, depth=2)
    assert len(out.chunks) == 6
    streams.exchange([out], [], [None], depth=2, after_first=lambda: calls.append(("copies",)))
    assert calls[:2] == [("batch", 1), ("copies",)] and calls.count(("copies",)) == 1 and len(calls) == 7
    calls.clear()
    streams.exchange([], [], [None], depth=2, after_first=lambda: calls.append(("copies",)))
    assert calls == [("copies",)]  # no stream: the copies are queued all the same


def _index(stream, chunk) -> int:
    return next(i for i, c in enumerate(stream.chunks) if c is chunk)


class _Job:
    """A HostUnpack stand-in: done after `polls` polls; records when it is finished."""

    def __init__(self, log, k, polls, fail=False):
        self.log, self.k, self.polls, self.fail = log, k, polls, fail

    def ready(self):
        self.polls -= 1
        return self.polls < 0

    def finish(self):
        if self.fail:
            raise RuntimeError(f"chunk {self.k} failed")
        self.log.append(("finished", self.k))


def test_host_chunks_finish_in_order_once_their_copy_is_done_and_all_before_return(posted, monkeypatch):
    recv = streams.PeerStream(1, [torch.zeros(64) for _ in range(3)], "cpu", chunk_bytes=128, depth=2)
    jobs = {}

    def unpack(chunk, buffer):
        k = _index(recv, chunk)
        posted.append(("unpacked", k))
        jobs[k] = _Job(posted, k, polls=0 if k != 1 else 10)  # chunk 1's copy takes long
        return jobs[k]

    monkeypatch.setattr(streams, "unpack_chunk", unpack)
    failure = streams.exchange([], [recv], [None], depth=2)
    assert failure is None
    finished = [k for what, k in posted if what == "finished"]
    assert finished == list(range(6))  # in chunk order: 2.. wait behind the slow chunk 1
    assert posted.index(("finished", 0)) < posted.index(("unpacked", 2))  # done ones finish early
    assert posted.index(("finished", 2)) > posted.index(("unpacked", 5))  # the slow one held the rest


def test_a_failing_host_chunk_is_reported_not_raised(posted, monkeypatch):
    recv = streams.PeerStream(1, [torch.zeros(64) for _ in range(3)], "cpu", chunk_bytes=128, depth=2)
    monkeypatch.setattr(streams, "unpack_chunk", lambda chunk, buffer: _Job(posted, _index(recv, chunk), 0,
                                                                            fail=_index(recv, chunk) == 1))
    failure = streams.exchange([], [recv], [None], depth=2)
    assert failure is not None and failure[:2] == ("unpack recv", 1) and "chunk 1 failed" in str(failure[2])
    assert sum(1 for c in posted if c[0] == "batch") == 6  # every batch still posted
