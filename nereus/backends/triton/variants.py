"""Kernel variants of the Packer (`Packer` inherits `VariantCompiler`): the (kind, word,
vec, ROWS, COLS) Triton specializations a pack, unpack or copy launches, compiled ahead
(`warm`, `compile`: each run once on a scratch buffer) or, under the "prepared" JIT, in a
background thread while the caller takes the torch path (`ready`, `compile_pending`), or
ahead of any call (`compile_ahead`).
Input: the variants, or the pack_into/unpack_from calls that would launch them, and the
data's device. Output: `compiled`, the variants known compiled, and `compile_log`, how
long each compile took. Invariant: one variant
compiles at a time, in the order asked for (`_Turns`), and a variant is marked compiled
only after it ran.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from typing import Sequence

import torch

from .segments import view_pieces
from .tables import build_launches, launch_classes

log = logging.getLogger("nereus.pack")


def _kernels():
    """The Triton kernels module, or None where triton does not import."""
    try:
        return importlib.import_module("nereus.backends.triton.kernels")
    except ImportError:
        return None


class _Turns:
    """A lock handed out first come, first served (a ticket lock): a thread that releases
    it and asks again queues behind the threads already waiting. A waiter interrupted
    while waiting gives its turn up."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket whose turn it is
        self._given_up: set = set()

    def __enter__(self):
        with self._cv:
            ticket = self._next
            self._next += 1
            try:
                while self._serving != ticket:
                    self._cv.wait()
            except BaseException:
                self._given_up.add(ticket)
                self._skip()
                raise

    def __exit__(self, *exc):
        with self._cv:
            self._serving += 1
            self._skip()
        return False

    def held(self) -> bool:
        """Whether some thread holds the lock now (tests)."""
        with self._cv:
            return self._serving < self._next and self._serving not in self._given_up

    def _skip(self) -> None:
        """(Holding the condition.) Pass over the turns given up; wake the waiters."""
        while self._serving in self._given_up:
            self._given_up.discard(self._serving)
            self._serving += 1
        self._cv.notify_all()


class VariantCompiler:
    """Mixin of `Packer` (module docstring). Uses the Packer's `backend_for`, `jit`,
    `compiled`, `tile`, `max_vec`, `fallback_calls` and the compile state its constructor
    sets (`_missing`, `_missing_device`, `_compiling`, `_compile_turns`, `compile_log`)."""

    def warm(self, calls: Sequence[tuple[str, Sequence[torch.Tensor], Sequence[int]]], device: torch.device) -> int:
        """Compile (and run once, on a small scratch buffer) every kernel variant that the
        given `pack_into`/`unpack_from` calls would launch, so the first real call does
        not wait for Triton's compiler. calls: [(kind "pack" | "unpack", views, offsets)];
        the views may be meta tensors of the real shapes and strides (a caching-allocator
        base is at least 512-byte aligned, as is a meta tensor's 0, so the word and vector
        classes come out the same). Returns the number of variants run (0 off Triton)."""
        device = torch.device(device)
        if self.backend_for(device) != "triton":
            return 0
        classes = self.launch_classes(calls)
        self.compile(classes, device)
        return len(classes)

    def compile(self, classes, device: torch.device) -> None:
        """Compile (and run once on a scratch buffer) the (kind, word, vec, ROWS, COLS)
        variants not compiled yet (e.g. a Replay's `classes`); nothing off Triton."""
        if self.backend_for(torch.device(device)) == "triton":
            self._compile(set(classes) - self.compiled, torch.device(device))

    def _compile(self, classes: set, device: torch.device) -> None:
        """Run each (kind, word, vec, ROWS, COLS) variant once on a scratch buffer, one
        variant at a time under the compile lock (a thread waiting for it waits for one
        variant, not for another thread's whole batch)."""
        if not set(classes) - self.compiled:
            return
        from .segments import Piece

        kernels = _kernels()
        base = kernels.anchor(device).data_ptr()
        scratch = torch.zeros(1024, dtype=torch.uint8, device=device)
        data, buffer = scratch.data_ptr(), scratch[512:].data_ptr()
        bases = torch.tensor([buffer - base], dtype=torch.int64).to(device)
        views = torch.tensor([data - base], dtype=torch.int64).to(device)
        for variant in sorted(classes):
            with self._compile_turns:
                if variant in self.compiled:  # compiled by another thread meanwhile
                    continue
                started = time.perf_counter()
                kind, word, vec, rows, cols = variant
                inner = 64 // word  # 64 bytes: every word size and alignment hint holds
                piece = Piece(word, vec, 0, 0, 1, inner, inner, inner, 0, 0)  # both sides relative
                rel = "dst" if kind == "pack" else "src"
                for launch in build_launches([piece], 0, rel, (rows, cols), vec):
                    kernels.run_launch(launch.to(device), kernels.REL_DST if kind == "pack" else kernels.REL_SRC,
                                       bases, views)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                self.compiled.add(variant)
                self.compile_log.append((variant, time.perf_counter() - started))

    def _compile_quietly(self, classes: set, device: torch.device) -> None:
        """The background compile: on the data's device (a new thread starts on device
        0); a failure only means the torch path stays in use for those variants."""
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    self._compile(classes, device)
            else:
                self._compile(classes, device)
        except Exception as error:  # noqa: BLE001 - the torch path still works
            log.warning("background compile of pack kernels failed: %s", error)

    def ready(self, classes, device: torch.device, start: bool = True) -> bool:
        """Whether launches of these (kind, word, vec, ROWS, COLS) variants may run now:
        always under jit "eager" (a variant compiles on first use); under "prepared" once
        each is compiled, the missing ones compiling in a background thread meanwhile
        (one at a time; the caller takes its torch path). start=False only queues them
        for `compile_pending`: Triton's compiler holds the GIL for much of a compile, so
        a compile running beside a transition slows the transition's own Python."""
        if self.jit != "prepared" or not self._queue(classes, device):
            return True
        if start:
            self.compile_pending()
        self.fallback_calls += 1
        return False

    def compile_ahead(self, classes, device: torch.device) -> bool:
        """Start compiling these (kind, word, vec, ROWS, COLS) variants in the background
        thread (`compile_pending`'s), the caller not waiting and no fallback counted (unlike
        `ready`); whether any was left to compile (none off Triton). Where a background
        compile runs already, they are only queued: the next `compile_pending` (after a
        transition) or `wait_compiled` compiles them."""
        device = torch.device(device)
        if self.backend_for(device) != "triton" or not self._queue(classes, device):
            return False
        self.compile_pending()
        return True

    def _queue(self, classes, device: torch.device) -> bool:
        """Queue the variants not compiled yet for `compile_pending`, on the caller's GPU
        where `device` has no index (the compile thread's own current device is GPU 0);
        whether there were any."""
        missing = set(classes) - self.compiled
        self._missing |= missing
        if missing:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._missing_device = device
        return bool(missing)

    def compile_pending(self) -> None:
        """Start compiling the queued variants in a background thread (when none runs)."""
        if not self._missing:
            return
        device = self._missing_device
        if self._compiling is None or not self._compiling.is_alive():
            import atexit

            todo = self._take_missing()
            if self._compiling is None:
                # a daemon thread still inside Triton's compiler when the interpreter
                # exits is killed in C++ code ("terminate called ...", exit status 134)
                atexit.register(self._join_compiling)
            self._compiling = threading.Thread(target=self._compile_quietly, args=(todo, device), daemon=True)
            self._compiling.start()

    def _join_compiling(self) -> None:
        if self._compiling is not None:
            self._compiling.join()

    def wait_compiled(self) -> None:
        """Block until every variant asked for so far is compiled: the background
        compile joined, the variants queued meanwhile compiled here (benchmarks time
        warm calls only after this)."""
        self._join_compiling()
        if self._missing:
            self._compile_quietly(self._take_missing(), self._missing_device)

    def _take_missing(self) -> set:
        todo, self._missing = self._missing, set()
        return todo

    def launch_classes(self, calls: Sequence[tuple[str, Sequence[torch.Tensor], Sequence[int]]]) -> set:
        """{(kind, word, vec, ROWS, COLS)} of the launches the Triton plans of these
        `pack_into`/`unpack_from` calls would make (see `warm`)."""
        classes = set()
        for kind, views, offsets in calls:
            pieces = [p for slot, (v, o) in enumerate(zip(views, offsets)) for p in view_pieces(v, o, 0, kind, slot)]
            classes |= {(kind,) + c for c in launch_classes(pieces, self.tile, self.max_vec)}
        return classes

    def classes_of(self, kind: str, pieces) -> set:
        """{(kind, word, vec, ROWS, COLS)} of the launches of these pieces (a list of
        Piece, or a table of them: replay.message_table): `launch_classes` for pieces
        already cut."""
        return {(kind,) + c for c in launch_classes(pieces, self.tile, self.max_vec)}
