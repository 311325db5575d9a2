"""A lowering process beside each rank: the lowering-ahead thread's lowering runs there,
off the training process's GIL.

Why: the lowering-ahead thread (nereus.runtime.ahead) shares its process's one GIL with
the training loop. Its lowering step (compile, the part's canonical JSON, parsing it back,
the work list and the execution plan: ~10^6 Python objects made) is pure Python, and a
thread that wants the GIL back while another runs Python waits up to the switch interval
(5 ms) each time; a training step that launches many small kernels wants it back after
every launch. On one H200 such a step (2,000 small ops, 14-21 ms alone) took up to
0.70-1.14 s once beside a lowering step of the 6-layer Qwen3-30B-A3B change, and a
GPU-bound step (8 bf16 matmuls of 8192^2) up to 0.07-0.60 s (benchmarks/RESULTS.md,
session 14, call 1). Here a process of this rank's own does that lowering and sends the
result back pickled; the thread only loads it (one call, with the cyclic collector paused:
~0.1 s on the CPU box for the 6-layer part, instead of ~1 s of Python). Measured with it
(session 14, call 3): the GPU-bound step's worst 31-39 ms, the launch-bound one's
0.48-0.66 s (the thread's plan and replay steps still run Python here); the cost, a first
call right after the Runtime's construction waited ~0.3-0.5 s longer for its lowering. The
runtime now starts the process first and gives it the whole work list at once
(`expect`): in session 15 such a call waited 0-0.32 s, the way back after the first
commit 0-0.09 s.

    lowerer = Lowerer(module, rank, direct_min_bytes)    # starts the process
    lowerer.expect(pairs)               # the thread's work list: asked for ahead, in order
    ticket = lowerer.request(source, target)              # None: the process is gone
    lowerer.answer(ticket, timeout_s)   # None (not yet) | ("ok", Lowering) | ("error" | "gone", why)
    lowerer.forget(ticket)              # not wanted any more (read past when it comes)
    lowerer.close()

The process imports no torch (the passes, the rank program: it starts in a few tenths of
a second); the thread builds the execution plan (meta tensors) after loading.

Invariant: nothing here is trusted more than the thread's own lowering was. The part's
text is what the runtime compares with the proven digest on every rank, and the work list
is its lowering by the same code (`rank_program`) in a process started from the same
environment (module-level switches changed in this process after its start do not reach
it: where they are flipped, lower ahead in the thread, NEREUS_AHEAD_PROCESS=0). A process
that does not start, ends, or is silent for TIMEOUT_S (then killed) only means the thread
lowers itself, as before; a lowering that fails there is left to the transition, which
lowers it and raises its error.

Setting: NEREUS_AHEAD_PROCESS (default 1; 0: the thread lowers in this process).
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Optional

from nereus.ir.diagnostics import env_flag

from . import child
from .gc_pause import paused

log = logging.getLogger("nereus.ahead")
ENABLED = env_flag("NEREUS_AHEAD_PROCESS", True)
TIMEOUT_S = 300.0  # a process that answers nothing for this long while asked: killed, lowered here


@dataclass(frozen=True)
class Lowering:
    """What the process sends back for one transition."""

    text: str  # the part's canonical JSON
    facts: object  # program.PartFacts of the part
    program: object  # this rank's RankProgram


class Lowerer:
    """The parent's end of one lowering process (module docstring). The process lowers
    one transition at a time, in the order asked; a pair asked for again before its answer
    is collected is not lowered twice. The process ends when `close` is called, when the
    Lowerer is collected, or at exit."""

    def __init__(self, module, rank: int, direct_min_bytes: int):
        self._tickets = itertools.count()
        self._wanted: set = set()  # tickets asked for and not forgotten
        self._pairs: dict = {}  # (source, target) -> its wanted ticket, until its answer is collected
        # (source, target) -> a ticket forgotten before its answer came: the process drops it
        # unless it is at it already; asked for again, the pair takes it back
        self._forgotten: dict = {}
        self._expected: dict = {}  # (source, target) -> ticket: asked for by expect()
        self._answers: dict = {}  # ticket -> ("ok", Lowering) | ("error", why), not collected yet
        self._heard = time.monotonic()  # when the process last answered (or was asked, if idle)
        self._ends, self._finalizer = child.owned_by(self)
        try:
            child.start("nereus.runtime.lowerer:serve", self._ends)
            self._ends.outbox.send(("module", module, rank, direct_min_bytes))
        except Exception as error:  # noqa: BLE001 - no process: the thread lowers itself, as before
            log.warning("lowering process did not start (%s: %s); lowering here", type(error).__name__, error)
            self.close()

    @property
    def alive(self) -> bool:
        process = self._ends.process
        return process is not None and process.poll() is None

    def request(self, source: str, target: str) -> Optional[int]:
        """Ask for this rank's lowering of source -> target; its ticket (the one already
        asked for, if its answer is in or the process may still be at it), or None
        (gone, and no answer of it in)."""
        pair = (source, target)
        if self.asked(source, target):
            return self._pairs[pair]
        if not self.alive:
            return None
        ticket = self._forgotten.pop(pair, None)
        if ticket is None:
            ticket = next(self._tickets)
        try:
            self._ends.outbox.send(("lower", ticket, source, target))
        except (OSError, ValueError):
            self._gone()
            return None
        if all(t in self._answers for t in self._pairs.values()):  # it was idle: silence counts from now
            self._heard = time.monotonic()
        self._pairs[pair] = ticket
        self._wanted.add(ticket)
        return ticket

    def expect(self, pairs) -> None:
        """The pairs the thread will want, in order: each not asked for yet is asked for
        now (the process lowers them one after another while the thread does other work,
        or is paused by a transition), and those expected before and no longer listed
        are forgotten (the process drops those it has not started). The process is at
        most one answer ahead of the reads: it waits for a finished answer to be read
        before it lowers the next pair."""
        pairs = list(dict.fromkeys(pairs))
        for pair, ticket in self._expected.items():
            if pair not in pairs and self._pairs.get(pair) == ticket:
                self.forget(ticket)
        self._expected = {}
        for pair in pairs:
            ticket = self.request(*pair)
            if ticket is not None:
                self._expected[pair] = ticket

    def asked(self, source: str, target: str) -> bool:
        """Whether this pair's answer is in and not collected, or the process (alive) was
        asked for it."""
        ticket = self._pairs.get((source, target))
        return ticket is not None and (ticket in self._answers or self.alive)

    def answer(self, ticket: Optional[int], timeout_s: float) -> Optional[tuple]:
        """("ok", Lowering), ("error", why) (the lowering raised there: lowered here it
        raises the same) or ("gone", why) (the process ended, or answered nothing for
        TIMEOUT_S and was killed) for `ticket` once it is in; None while the process is
        still at it after waiting `timeout_s` (without the GIL). Answers to forgotten
        tickets are read past without being loaded."""
        if ticket not in self._wanted:
            return ("gone", "not asked")
        end = time.monotonic() + timeout_s
        while ticket not in self._answers:
            try:
                if not self._ends.inbox.poll(max(0.0, min(end, self._heard + TIMEOUT_S) - time.monotonic())):
                    if time.monotonic() < self._heard + TIMEOUT_S:
                        return None
                    log.warning("lowering process silent for %.0f s; lowering here", TIMEOUT_S)
                    self._ends.kill()
                    self._gone()
                    return ("gone", f"silent for {TIMEOUT_S:.0f} s")
                status, got = pickle.loads(self._ends.inbox.recv_bytes())  # the header, then its payload
                data = self._ends.inbox.recv_bytes()
                self._heard = time.monotonic()
                if got not in self._wanted:  # forgotten: read past (a request now asks again)
                    self._forgotten = {k: t for k, t in self._forgotten.items() if t != got}
                else:
                    with paused():  # ~10^5 objects at once: no collection in the middle of them
                        self._answers[got] = (status, pickle.loads(data))
            except BaseException as error:  # ended (EOF), killed, an answer that does not load, or interrupted
                if not isinstance(error, Exception):  # mid-message: the stream cannot be trusted after it
                    self._gone()
                    raise
                if not isinstance(error, EOFError):
                    log.warning("lowering process failed (%s: %s); lowering here", type(error).__name__, error)
                self._gone()
                return ("gone", f"{type(error).__name__}: {error}")
        self._wanted.discard(ticket)
        self._pairs = {k: t for k, t in self._pairs.items() if t != ticket}
        return self._answers.pop(ticket)

    def forget(self, ticket: Optional[int]) -> None:
        """Its answer will not be collected: dropped if in; else the process is told to
        drop the request (if it has not started it), and an answer that comes anyway is
        read past (a request for the same pair before then takes the ticket back)."""
        if ticket not in self._wanted:
            return
        self._wanted.discard(ticket)
        pair = next((k for k, t in self._pairs.items() if t == ticket), None)
        if pair is not None:
            del self._pairs[pair]
        if self._answers.pop(ticket, None) is None and pair is not None and self.alive:
            self._forgotten[pair] = ticket
            try:
                self._ends.outbox.send(("forget", ticket))
            except (OSError, ValueError):
                self._gone()

    def _gone(self) -> None:
        """The process failed: end it; the answers already in are kept for their pairs
        (request() hands them out, the process gone or not)."""
        kept = {t: a for t, a in self._answers.items() if t in self._wanted}
        pairs = {k: t for k, t in self._pairs.items() if t in kept}
        self.close()
        self._answers, self._pairs, self._wanted = kept, pairs, set(kept)

    def close(self) -> None:
        """End the process (it exits when its input closes; killed if it does not)."""
        self._wanted.clear()
        self._pairs.clear()
        self._forgotten.clear()
        self._expected.clear()
        self._answers.clear()
        self._finalizer()


def lower(module, rank: int, direct_min_bytes: int, source: str, target: str) -> Lowering:
    """This rank's lowering of source -> target as the thread makes it (`ahead.steps`),
    less the execution plan (torch's meta tensors; the thread builds it next). Imports no
    torch: the process starts in a few tenths of a second."""
    from nereus.backends.proof import rank_part
    from nereus.backends.rank_json import canonical_json
    from nereus.passes import compile_transition
    from nereus.passes.manager import PROGRAM_PIPELINE

    from .program import lower_text

    text = canonical_json(rank_part(compile_transition(module, source, target, pipeline=PROGRAM_PIPELINE), rank))
    return Lowering(text, *lower_text(text, rank, direct_min_bytes))


def serve(read_fd: int, write_fd: int) -> None:
    """The lowering process. Receives ("module", Module, rank, direct_min_bytes) once, then
    ("lower", ticket, source, target) and ("forget", ticket) (a request not started yet is
    dropped); each request is answered, in the order asked, by two messages (bytes of
    pickles): (status, ticket), then a Lowering (status "ok") or why it failed ("error").
    Every message that came is read before the next lowering starts. Ends when its input
    closes."""
    import gc
    from collections import OrderedDict
    from multiprocessing.connection import Connection

    gc.disable()  # a lowering makes ~10^6 objects; what outlives it is collected after the answer
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    module = rank = direct_min_bytes = None
    pending: OrderedDict = OrderedDict()  # ticket -> (source, target), not started
    answered: set = set()  # tickets started (a "lower" of one again, re-sent by the parent, is ignored)
    while True:
        while not pending or inbox.poll(0):  # wait for work; read all that came before starting any
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                return
            if message[0] == "module":
                _, module, rank, direct_min_bytes = message
            elif message[0] == "lower":
                if message[1] not in answered:
                    pending.setdefault(message[1], message[2:])
            elif message[0] == "forget":
                pending.pop(message[1], None)
        ticket, (source, target) = pending.popitem(last=False)
        answered.add(ticket)
        try:
            status, data = "ok", pickle.dumps(lower(module, rank, direct_min_bytes, source, target),
                                              protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - the runtime lowers it itself and raises there
            status, data = "error", pickle.dumps(f"{type(error).__name__}: {error}")
        try:  # a small header first: the parent reads past a payload nobody wants without loading it
            outbox.send_bytes(pickle.dumps((status, ticket)))
            outbox.send_bytes(data)
        except (BrokenPipeError, OSError):
            return
        del data
        gc.collect()
