"""Lowering ahead: while the job trains, a thread of each rank lowers that rank's parts of
the transitions from the current plan and of the ways back to it (the runtime gives it
the pairs), builds their execution plans and replays and compiles their pack kernels, so
a first `transition()` finds them done.

Why: a first transition's own host work is what `Runtime.prepare` takes out of the call,
but a user who did not prepare paid it inside the call. On one H200, a cold 6-layer
Qwen3-30B-A3B expert-parallel change spent 0.56 s lowering this rank's part (compile, its
work list, its execution plan) and then ran its first execution on the per-piece torch
path, since its replays are built from the second execution on and its kernel variants
compile after the call (1.24-2.03 s against a 0.09-0.17 s warm call; benchmarks/RESULTS.md,
session 12). None of that needs the other ranks or the live tensors: the passes are
deterministic and a part depends on the module and the transition alone. So it can run
before the call, while the training step keeps the GPU busy and the host mostly waits.

    ahead = Ahead(steps, lowerer=None)   # steps(source, target) -> a generator (below)
    ahead.at_plan(pairs)                 # work on these (source, target) pairs, in order
    with ahead.paused():                 # the main thread's own transition or prepare
        done = ahead.take(source, target)  # its lowering, or None (the caller lowers itself)
    ahead.close()

`steps(source, target)` (nereus.runtime.ahead_steps) is a generator run one step at a time
in the thread: it may first yield WAITING (a short wait for the lowering process,
nereus.runtime.lowerer), then its first other yield gives the lowering (whatever the
caller takes back), and each later yield ends one more step (the execution plan, the
stream kernel variants it needs, one compiled per step, then per replay its build and its
variants not compiled yet, one per step). A step that yields LATER says the rest of its
pair can wait: the thread parks it, does the queued pairs' steps up to their LATER first
(also those of pairs a new plan queues later), then the parked pairs' later steps in the
work list's order (a first call needs its lowering, plan and stream variants; the replays
only save host time, so the way back of a switch made right after construction is ready
before the first pair's replays are built: session 15 saw such ways back take the torch
path for ~100 chunks, ~0.3-0.4 s).
A lowered pair no longer in the list stays parked, with its lowering, until it is again.

`paused()` waits for the step in progress, if any, and holds later steps until the block
ends: the main thread's transition never runs beside a step (the two would share one GIL,
and a step's caches beside the call's); `paused_all()` does it for every thread of the
process (a transition, a weight sync). `take` hands over a finished lowering (one the
lowering process is still at is waited for, in the caller; so are the rest of the later
steps of a pair whose replays the thread began building: a first call with some of its
replays and not the others runs the others' streams on the slower per-call path) and
drops the transition from the work list. With a lowering process, the work list is its too
(Lowerer.expect): it lowers the pairs in that order, one ahead of the thread, also while
a transition pauses the thread, and `take` waits for a pair it has even if the thread
has not started that pair.

Invariant: nothing here is trusted. The lowered part still has its digest compared with
the proven program's on every rank (nereus.runtime.distribute); a step that fails only
means the main thread does that work itself (and raises its error there); no step runs a
collective or touches a registered tensor.

Setting: Runtime(ahead=...) or NEREUS_LOWER_AHEAD: "on", "off" or "auto" (the default: on
for CUDA devices, where a first call's host work is the transition's; off on CPU, where
tests and gloo runs would start a thread per runtime for little gain).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager, suppress
from typing import Callable, Iterator, Optional

from nereus.ir.diagnostics import NereusError

from . import ahead_threads as threads
from . import intraop
# the steps of one transition (and their protocol's sentinels), importable from here too
from .ahead_steps import (LATER, LOWERER_POLL_S, WAITING, Lowered, LoweringFailed, close_steps, first_value,
                          lower_part, step_name, steps)
from .ahead_threads import paused_all

log = logging.getLogger("nereus.ahead")
MODES = ("auto", "on", "off")


def ahead_mode(requested, device_type: str) -> bool:
    """Whether a runtime on `device_type` lowers ahead (argument: True/False or a mode,
    else NEREUS_LOWER_AHEAD, else auto)."""
    if isinstance(requested, bool):
        return requested
    mode = requested or os.environ.get("NEREUS_LOWER_AHEAD") or "auto"
    mode = {"1": "on", "0": "off"}.get(mode, mode)
    if mode not in MODES:
        raise NereusError(f"unknown lower-ahead mode {mode!r}",
                          hint="ahead='auto' (on for CUDA), 'on' or 'off' (NEREUS_LOWER_AHEAD)")
    return device_type == "cuda" if mode == "auto" else mode == "on"


class Ahead:
    """The lowering-ahead thread of one runtime (module docstring)."""

    def __init__(self, steps: Callable[[str, str], Iterator], name: str = "nereus-ahead", lowerer=None):
        self._steps = steps
        self._lowerer = lowerer  # the lowering process `steps` asks (lowerer.Lowerer), told the work list ahead
        self._cv = threading.Condition()
        self._queue: deque = deque()  # (source, target) not started
        self._current = None  # (key, generator, whether its lowering is in) started and not finished
        # key -> generator of a lowered pair parked (at its LATER, or while not wanted): resumed
        # when nothing is queued, the first in the work list's order first
        self._later: OrderedDict = OrderedDict()
        self._order: dict = {}  # key -> its place in the work list (the pairs wanted now)
        self._past_later: set = set()  # keys whose steps yielded LATER (their first-call work is done)
        self._replaying: set = set()  # keys that ran a step after their LATER (their later work is begun)
        self._done: OrderedDict = OrderedDict()  # key -> what its first step gave (oldest first)
        self._started: set = set()  # keys started and not dropped: each is worked on once
        self._paused = 0
        self._stepping = False
        self._closed = False
        self.failed: dict = {}  # key -> repr of the error a step raised (for tests and logs)
        # (source, target, who: "thread" | "caller", what: "waiting" (a poll of the lowering
        # process), "lowered", "later", "end", "failed", a step's own name ("plan",
        # "streams", "compile", "replay": ahead_steps) or "step", time.monotonic() at its
        # start, seconds) per step, the latest STEP_LOG of them (where a first call's wait went)
        self.step_log: deque = deque(maxlen=STEP_LOG)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        threads.register(self)
        self._thread.start()

    # -- the main thread ------------------------------------------------------------------

    def at_plan(self, pairs) -> None:
        """The work list is now `pairs` ((source, target), in order), less the ones started
        already: each pair is lowered once, and what was lowered for a pair no longer in
        the list is kept for when it is again (a job moving between two plans of many does
        not lower the others again after every commit), up to KEEP_UNWANTED of them, the
        oldest dropped first (a dropped pair may be lowered again later); so are its steps
        not run yet (parked: they resume when it is wanted again). A pair whose first-call
        work is done (past its LATER) waits for the first-call work of new pairs and of
        parked pairs wanted again."""
        pairs = list(dict.fromkeys(pairs))
        with self._held():
            wanted = set(pairs)
            self._order = {k: i for i, k in enumerate(pairs)}
            self._queue = deque(k for k in pairs if k not in self._started)  # (what is done was started)
            unwanted = [k for k in self._done if k not in wanted]
            for key in unwanted[:max(0, len(unwanted) - KEEP_UNWANTED)]:
                del self._done[key]
                self._started.discard(key)
                self._unpark(key)
            if self._current is not None:
                key, _, lowered = self._current
                if key not in wanted and (not lowered or key not in self._done):  # (lowering dropped above)
                    if not lowered:  # it may be lowered again
                        self._started.discard(key)
                    self._drop_current()
                elif key not in wanted or (key in self._past_later and self._first_call_work_waits()):
                    self._later[key] = self._current[1]  # parked: kept for when it is wanted (again)
                    self._current = None
            self._expect()

    def _expect(self) -> None:
        """(Holding the thread.) Tell the lowering process the pairs still to lower, in
        order: it lowers the next while the thread builds replays or a transition pauses
        it (a job switching back right after a commit finds the way back lowered)."""
        if self._lowerer is None:
            return
        pairs = list(self._queue)
        if self._current is not None and not self._current[2]:
            pairs.insert(0, self._current[0])
        try:
            self._lowerer.expect(pairs)
        except Exception as error:  # noqa: BLE001 - the steps then lower what the process does not
            log.debug("lowering process: expect failed: %r", error)

    @contextmanager
    def paused(self):
        """No step runs while the block runs; entering waits for the step in progress."""
        with threads.pausing([self]):
            yield self

    def _hold(self) -> None:
        """No step starts from now on (until `_release`)."""
        with self._cv:
            self._paused += 1

    def _wait_step(self) -> None:
        with self._cv:
            while self._stepping:
                self._cv.wait()

    def _release(self) -> None:
        with self._cv:
            self._paused -= 1
            self._cv.notify_all()

    def take(self, source: str, target: str, wait_s: float = 60.0):
        """What the first step of (source, target) gave, or None (not lowered yet, or it
        failed); the pair leaves the work list either way. A lowering the lowering process
        is still at is waited for here, and the later steps of a pair whose replays the
        thread began building are finished here, each until `wait_s` has passed (the step
        then in progress still ends; the runtime gives a part of its collective timeout:
        the other ranks wait for this one meanwhile). Call inside `paused()`."""
        key = (source, target)
        with self._held():
            self._started.add(key)
            if self._current is not None and self._current[0] == key:
                _, generator, lowered = self._current
                if generator is not None and not lowered:  # the lowering process is at it: wait for it here
                    self._wait_in_caller(key, generator, wait_s)
                elif key in self._replaying:
                    self._finish_in_caller(key, generator, wait_s)
                self._drop_current()  # (its generator forgets a lowering not waited for to the end)
            elif key in self._later:  # lowered and parked: its later steps are dropped, or finished if begun
                generator = self._later.pop(key)  # (out of reach of close() while the caller runs it)
                if key in self._replaying:
                    self._finish_in_caller(key, generator, wait_s)
                close_steps(generator)
                self._unpark(key)
            elif key in self._queue and key not in self._done and self._asked(key):
                # not started by the thread, but the lowering process has it (expect): its steps run here
                generator = self._steps(*key)
                try:
                    self._wait_in_caller(key, generator, wait_s)
                finally:
                    generator.close()
            try:
                self._queue.remove(key)
            except ValueError:
                pass
            self._expect()
            return self._done.pop(key, None)

    def _asked(self, key) -> bool:
        try:
            return self._lowerer is not None and self._lowerer.asked(*key)
        except Exception:  # noqa: BLE001 - the caller lowers itself
            return False

    def _wait_in_caller(self, key, generator, wait_s: float) -> None:
        """(Holding the thread.) Run `generator` to its lowering here, at most `wait_s`
        (with the lock released; the thread is held: idle() and close() see a step)."""
        with self._stepping_here():
            value = first_value(generator, wait_s)
        if value is not None:
            self._done[key] = value

    @contextmanager
    def _stepping_here(self):
        """(Holding the thread.) The block runs steps in the caller, the lock released:
        idle() and close() see a step in progress, as the thread's own."""
        self._stepping = True
        self._cv.release()
        try:
            yield
        finally:
            self._cv.acquire()
            self._stepping = False

    def _finish_in_caller(self, key, generator, wait_s: float) -> None:
        """(Holding the thread.) Run the rest of a pair's later steps here until `wait_s`
        has passed (the step then in progress still ends): a pair whose replays the thread
        began building would otherwise run its first call with some replays and not the
        others, and a stream without its replay takes the per-call path (one H200, the
        6-layer Qwen3-30B-A3B change's way back: 0.2-0.4 s of exchange against 23-53 ms
        replayed, session 19), longer than the rest of the build. Each step goes into the
        step log ("caller"), a failure into `failed` too."""
        end = time.monotonic() + wait_s
        over, failed = False, None
        with self._stepping_here():
            while not over:
                started, what = time.monotonic(), "end"
                try:
                    what = step_name(next(generator))
                except StopIteration:
                    over = True
                except Exception as error:  # noqa: BLE001 - the call builds what is missing (or takes the per-call path)
                    what, failed, over = "failed", error, True
                    log.debug("lowering ahead: finishing %s -> %s failed: %r", key[0], key[1], error)
                self.step_log.append((*key, "caller", what, started, time.monotonic() - started))
                if not over and time.monotonic() >= end:
                    log.debug("lowering ahead: %s -> %s still not done after %.1f s", key[0], key[1], wait_s)
                    break
        if failed is not None:
            self.failed[key] = repr(failed)

    @contextmanager
    def _held(self):
        """The lock, with no step in progress and none starting until the block ends (the
        thread takes the lock back between its steps at once: a caller merely waiting for
        the lock could wait as long as steps keep coming)."""
        with self._cv:
            self._paused += 1
            try:
                self._cv.wait_for(lambda: not self._stepping)
                yield
            finally:
                self._paused -= 1
                self._cv.notify_all()

    def idle(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until nothing is left to do (or the thread is closed); whether it came to
        that within `timeout_s`."""
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or (not self._stepping and self._current is None
                                                                and not self._queue
                                                                and self._next_parked() is None), timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop after the step in progress; the thread is joined (a daemon thread still
        inside Triton's compiler at interpreter exit aborts the process)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._done.clear()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        with self._cv:
            if self._current is not None and not self._stepping:
                self._drop_current()
            while self._later:
                close_steps(self._later.popitem(last=False)[1])

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def _after_fork_in_child(self) -> None:
        """A forked child has no thread: nothing is stepping or queued there, and the lock
        (perhaps held by the parent's thread at the fork) is a new one."""
        self._cv = threading.Condition()
        self._closed, self._stepping, self._paused = True, False, 0
        self._current, self._queue, self._done, self._later = None, deque(), OrderedDict(), OrderedDict()
        self._past_later, self._replaying = set(), set()

    # -- the thread -----------------------------------------------------------------------

    def _drop_current(self) -> None:
        """(Holding the lock, no step running.) Close the started generator."""
        key, generator, _ = self._current
        self._current = None
        self._past_later.discard(key)
        self._replaying.discard(key)
        close_steps(generator)

    def _unpark(self, key) -> None:
        """(Holding the lock.) Close the parked generator of `key`, if any."""
        self._past_later.discard(key)
        self._replaying.discard(key)
        close_steps(self._later.pop(key, None))

    def _first_call_work_waits(self) -> bool:
        """(Holding the lock.) Whether a wanted pair's first-call work is still to do: one
        queued, or one parked before its LATER."""
        parked = self._next_parked()
        return bool(self._queue) or (parked is not None and parked not in self._past_later)

    def _next_parked(self):
        """(Holding the lock.) The wanted parked pair to resume, or None: one whose
        first-call work is not done (parked while it was not wanted) before any other's
        later steps, each kind in the work list's order."""
        return min((k for k in self._later if k in self._order),
                   key=lambda k: (k in self._past_later, self._order[k]), default=None)

    def _run(self) -> None:
        try:
            # the steps' torch operators on this thread alone: with the process's OpenMP team,
            # beside a busy main thread, a replay build took up to 2 s (nereus.runtime.intraop)
            if not intraop.one_intraop_thread():
                log.debug("lowering ahead: torch's operators keep the process's intra-op threads here")
        except Exception as error:  # noqa: BLE001 - only slower without it
            log.debug("lowering ahead: one intra-op thread: %r", error)
        try:
            self._loop()
        finally:  # paused_all waits for a thread's steps as long as it runs, closed or not
            threads.unregister(self)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or (not self._paused and (
                    self._current or self._queue or self._next_parked() is not None)))
                if self._closed:
                    return
                if self._current is None and self._queue:
                    key = self._queue.popleft()
                    self._started.add(key)
                    self._current = (key, None, False)
                elif self._current is None:  # nothing queued: resume the first parked pair of the list
                    key = self._next_parked()
                    self._current = (key, self._later.pop(key), True)
                key, generator, lowered = self._current
                self._stepping = True
            value, finished, failed = None, False, None
            with suppress(Exception):  # again each step: a library's first use here may reset it
                intraop.one_intraop_thread()
            started = time.monotonic()
            try:
                with threads.short_switch():
                    if generator is None:
                        generator = self._steps(*key)
                    value = next(generator)
            except StopIteration:
                finished = True
            except BaseException as error:  # noqa: BLE001 - the main thread does it itself, and raises
                finished, failed = True, error
            seconds = time.monotonic() - started
            if not isinstance(failed, (Exception, type(None))):  # SystemExit and the like: the thread ends
                with self._cv:
                    self._closed, self._stepping, self._current = True, False, None
                    self._cv.notify_all()
                return
            with self._cv:
                self._stepping = False
                if self._closed:  # closed during the step (close() gave up waiting): nothing is kept
                    self._current = None
                    close_steps(generator)
                    self._cv.notify_all()
                    return
                now_lowered = lowered or (not finished and failed is None and value is not WAITING
                                          and value is not LATER)
                what = "failed" if failed is not None else "end" if finished else \
                    "lowered" if now_lowered and not lowered else step_name(value)
                self.step_log.append((*key, "thread", what, started, seconds))
                self._current = None if finished else (key, generator, now_lowered)
                if key in self._past_later and value is not LATER and not finished:
                    self._replaying.add(key)
                if finished:
                    self._past_later.discard(key)
                    self._replaying.discard(key)
                elif value is LATER and lowered:  # parked: the queued pairs' first-call work first, then
                    self._past_later.add(key)      # the parked pairs' later steps in list order (this one too)
                    self._later[key] = generator
                    self._current = None
                if failed is not None:
                    self.failed[key] = repr(failed)
                    log.debug("lowering ahead %s -> %s failed: %r", key[0], key[1], failed)
                elif now_lowered and not lowered:
                    self._done[key] = value
                self._cv.notify_all()


# lowered pairs kept while not in the work list (each a RankProgram of up to ~10^5 objects,
# which every full garbage collection scans, and its replays' device tables)
KEEP_UNWANTED = 8
STEP_LOG = 512  # steps Ahead.step_log keeps


__all__ = ["LATER", "LOWERER_POLL_S", "MODES", "WAITING", "Ahead", "Lowered", "LoweringFailed", "ahead_mode", "lower_part",
           "paused_all", "steps"]
