"""Lowering ahead: while the job trains, a thread of each rank lowers that rank's parts of
the transitions from the current plan, builds their execution plans and replays and
compiles their pack kernels, so a first `transition()` finds them done.

Why: a first transition's own host work is what `Runtime.prepare` takes out of the call,
but a user who did not prepare paid it inside the call. On one H200, a cold 6-layer
Qwen3-30B-A3B expert-parallel change spent 0.56 s lowering this rank's part (compile, its
work list, its execution plan) and then ran its first execution on the per-piece torch
path, since its replays are built from the second execution on and its kernel variants
compile after the call (1.24-2.03 s against a 0.09-0.17 s warm call; benchmarks/RESULTS.md,
session 12). None of that needs the other ranks or the live tensors: the passes are
deterministic and a part depends on the module and the transition alone. So it can run
before the call, while the training step keeps the GPU busy and the host mostly waits.

    ahead = Ahead(steps)                 # steps(source, target) -> a generator (below)
    ahead.at_plan(plan, targets)         # the runtime is in `plan`: work on these transitions
    with ahead.paused():                 # the main thread's own transition or prepare
        done = ahead.take(source, target)  # its lowering, or None (the caller lowers itself)
    ahead.close()

`steps(source, target)` is a generator run one step at a time in the thread: its first
yield gives the lowering (whatever the caller takes back), each later yield ends one more
step (building replays, compiling one kernel variant). `paused()` waits for the step in
progress, if any, and holds later steps until the block ends: the main thread's
transition never runs beside a step (the two would share one GIL, and a step's caches
beside the call's). `take` hands over a finished lowering and drops the transition from
the work list.

Invariant: nothing here is trusted. The lowered part still has its digest compared with
the proven program's on every rank (nereus.runtime.distribute); a step that fails only
means the main thread does that work itself (and raises its error there); no step runs a
collective or touches a registered tensor.

Setting: Runtime(ahead=...) or NEREUS_LOWER_AHEAD: "on", "off" or "auto" (the default: on
for CUDA devices, where a first call's host work is the transition's; off on CPU, where
tests and gloo runs would start a thread per runtime for little gain).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from nereus.ir.diagnostics import NereusError

from . import offload, packing, streams
from .execution_plan import plan_for
from .program import rank_program

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

    def __init__(self, steps: Callable[[str, str], Iterator], name: str = "nereus-ahead"):
        self._steps = steps
        self._cv = threading.Condition()
        self._queue: deque = deque()  # (source, target) not started
        self._current = None  # (key, generator) started and not finished
        self._done: dict = {}  # key -> what its first step gave
        self._paused = 0
        self._stepping = False
        self._closed = False
        self.failed: dict = {}  # key -> repr of the error a step raised (for tests and logs)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the main thread ------------------------------------------------------------------

    def at_plan(self, source: str, targets) -> None:
        """The runtime is now in `source`: work on (source, t) for each of `targets`, in
        order; what was queued or done for another source is dropped."""
        with self._cv:
            while self._stepping:
                self._cv.wait()
            self._queue = deque((source, t) for t in targets if t != source and (source, t) not in self._done)
            self._done = {k: v for k, v in self._done.items() if k[0] == source}
            if self._current is not None and self._current[0][0] != source:
                self._drop_current()
            self._cv.notify_all()

    @contextmanager
    def paused(self):
        """No step runs while the block runs; entering waits for the step in progress."""
        with self._cv:
            self._paused += 1
            while self._stepping:
                self._cv.wait()
        try:
            yield self
        finally:
            with self._cv:
                self._paused -= 1
                self._cv.notify_all()

    def take(self, source: str, target: str):
        """What the first step of (source, target) gave, or None (not lowered yet, or it
        failed); the transition leaves the work list either way. Call inside `paused()`."""
        key = (source, target)
        with self._cv:
            while self._stepping:  # outside paused(): the step in progress ends first
                self._cv.wait()
            if self._current is not None and self._current[0] == key:
                self._drop_current()
            try:
                self._queue.remove(key)
            except ValueError:
                pass
            return self._done.pop(key, None)

    def idle(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until nothing is left to do (or paused, or closed); whether it came to that."""
        with self._cv:
            return self._cv.wait_for(lambda: self._closed or (not self._stepping and self._current is None
                                                                and not self._queue), timeout_s)

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

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the thread -----------------------------------------------------------------------

    def _drop_current(self) -> None:
        """(Holding the lock, no step running.) Close the started generator."""
        _, generator = self._current
        self._current = None
        try:
            generator.close()
        except Exception:  # noqa: BLE001 - a generator's cleanup failing loses nothing
            pass

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or (not self._paused and (self._current or self._queue)))
                if self._closed:
                    return
                if self._current is None:
                    key = self._queue.popleft()
                    self._current = (key, None)
                key, generator = self._current
                self._stepping = True
            value, finished, failed = None, False, None
            try:
                if generator is None:
                    generator = self._steps(*key)
                value = next(generator)
            except StopIteration:
                finished = True
            except Exception as error:  # noqa: BLE001 - the main thread does it itself, and raises
                finished, failed = True, error
            with self._cv:
                self._stepping = False
                first = self._current[1] is None
                self._current = None if finished else (key, generator)
                if failed is not None:
                    self.failed[key] = repr(failed)
                    log.debug("lowering ahead %s -> %s failed: %r", key[0], key[1], failed)
                elif first and not finished:
                    self._done[key] = value
                self._cv.notify_all()


@dataclass(frozen=True)
class Lowered:
    """A transition's part as this rank lowered it ahead (the first step's value)."""

    text: str  # the part's canonical JSON (what its digest hashes)
    value: tuple  # lower_part(text): (the part as a dict, this rank's RankProgram)
    compiled: object  # the compiled transition (rank 0 without a prover proves it inline), else None
    seconds: float  # the thread's time to lower it


def lower_part(text: str, rank: int, direct_min_bytes: int) -> tuple:
    """(the part as a dict, this rank's work list from it), its execution plan built too
    (kept by execution_plan.plan_for): what a runtime needs of a new part."""
    program = json.loads(text)
    lowered = rank_program(program, rank, direct_min_bytes)
    plan_for(lowered, streams.CHUNK_BYTES)
    return program, lowered


def steps(module, rank: int, device, direct_min_bytes: int, keep_compiled: bool, source: str,
          target: str) -> Iterator:
    """The work of one transition, a step per yield: lower this rank's part (yields a
    Lowered); on CUDA, build its replays (the execution plan's, as Runtime.prepare does)
    and compile each of its kernel variants, one per step. What the runtime's own
    transition would otherwise do in its first and second calls."""
    from nereus.backends.rank_json import canonical_json

    from .distribute import _lower_own_part

    started = time.perf_counter()
    compiled, part = _lower_own_part(module, source, target, rank)
    text = canonical_json(part)
    value = lower_part(text, rank, direct_min_bytes)
    yield Lowered(text, value, compiled if keep_compiled else None, time.perf_counter() - started)
    del compiled, part
    device = torch.device(device)
    if device.type != "cuda" or packing.kernels() is None:
        return
    from .executor import TORCH_DTYPES
    from .prepare import kernel_classes

    program, lowered = value
    with torch.cuda.device(device):
        streamed, replayed = kernel_classes(lowered, device, TORCH_DTYPES, offload.offloaded_units(program))
        torch.cuda.current_stream(device).synchronize()  # the replays' tables are on the device
    del program, lowered, value
    yield None
    packer = packing.kernels().default_packer()
    for variant in sorted(streamed | replayed):
        if variant not in packer.compiled:
            with torch.cuda.device(device):
                packer.compile({variant}, device)
            yield None
