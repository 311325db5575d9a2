"""Compiling pack kernel variants in a child process, so that Triton's compiler does not
hold the training process's GIL.

Why: a kernel variant the packer has not compiled yet is compiled in a background thread
(the packer's compile after a first transition, the runtime's lowering-ahead thread
before it). Much of a Triton compile is C++ that keeps the GIL, so the training loop
beside it stalls: on one H200 a launch-bound step (2,000 small ops) took up to 0.64-1.19 s
once while the lowering-ahead thread compiled, against a few ms otherwise
(benchmarks/RESULTS.md, session 13).

How: the child imports the kernels and compiles each variant with `kernels.compile_only`
(Triton's `warmup`: dtypes for tensors, no launch) into Triton's on-disk cache, which the
parent shares (the child inherits its environment, so TRITON_CACHE_DIR and every
compile-relevant setting agree). The child sees only the parent's GPU
(CUDA_VISIBLE_DEVICES), so it compiles for that GPU's architecture. The parent then runs
each variant once itself, as before, and Triton finds the compiled kernel in its cache:
loading it takes milliseconds instead of a compile.

    batch = compile_child.start(variants, device)   # None: children are off here
    batch.wait(0.05)                                 # True once every child of it ended

Invariant: nothing the child does is trusted. The parent still compiles (or loads) and
runs every variant itself; a child that cannot start, fails, or runs past DEADLINE_S
(killed) only means the parent compiles in its own thread as it did before. The first
such failure turns children off for the process (logged once on `nereus.pack`) rather
than paying a failing start for every batch. Children of one process never compile the
same variant twice at once: a variant already in a running child is waited for, not
started again.

Setting: NEREUS_PACK_COMPILE "process" (the default) or "inline" (compile in the
background thread itself, as before).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger("nereus.pack")
MODES = ("process", "inline")
DEADLINE_S = 300.0  # a child still compiling after this is killed (a compile takes ~1 s)
_lock = threading.Lock()
_running: dict = {}  # (visible device, variant) -> _Child compiling it
_children: list = []  # children started and not reaped
_off: Optional[str] = None  # why children are off in this process (the first failure)


def mode() -> str:
    """NEREUS_PACK_COMPILE, checked."""
    chosen = os.environ.get("NEREUS_PACK_COMPILE") or "process"
    if chosen not in MODES:
        raise ValueError(f"NEREUS_PACK_COMPILE={chosen!r}: choose one of {', '.join(MODES)}")
    return chosen


@dataclass(eq=False)
class _Child:
    process: subprocess.Popen
    variants: tuple
    stderr: object  # a temporary file (a pipe nobody reads could fill and block the child)
    started: float = field(default_factory=time.monotonic)
    error: Optional[str] = None  # set once it ended badly

    def poll(self) -> bool:
        """Whether it ended (reaped; killed past the deadline)."""
        if self.process.poll() is None:
            if time.monotonic() - self.started < DEADLINE_S:
                return False
            self.process.kill()
            self.process.wait()
            self.error = f"still compiling after {DEADLINE_S:.0f} s: killed"
        elif self.process.returncode != 0 and self.error is None:
            self.stderr.seek(0)
            lines = self.stderr.read().decode(errors="replace").strip().splitlines()
            self.error = f"exit status {self.process.returncode}: " + (lines[-1] if lines else "no output")
        return True


@dataclass(eq=False)
class Batch:
    """The children compiling one request's variants (some perhaps started by others)."""

    children: tuple

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Wait up to `timeout_s` (None: until they end, at most DEADLINE_S each) for the
        children, without the GIL; whether all ended. Ending badly turns children off."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for child in self.children:
            while not child.poll():
                left = DEADLINE_S if end is None else end - time.monotonic()
                if left <= 0:
                    return False
                try:
                    child.process.wait(min(left, max(0.0, DEADLINE_S - (time.monotonic() - child.started)) + 0.01))
                except subprocess.TimeoutExpired:
                    pass
            _ended(child)
        return True


def _visible(device: torch.device) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the parent's `device` (its index among the
    parent's visible devices)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return str(index)
    entries = [x.strip() for x in parent.split(",") if x.strip()]
    return entries[index] if index < len(entries) else str(index)


def command() -> list:
    """The child's command line (tests replace it)."""
    return [sys.executable, "-m", __name__]


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start(variants, device, new: bool = True) -> Optional[Batch]:
    """Children compiling `variants` ((kind, word, vec, ROWS, COLS)) for the CUDA
    `device`: the running ones that have some of them, and (`new`) one more for the rest.
    None where children are off (NEREUS_PACK_COMPILE=inline, a device other than CUDA, an
    earlier child that failed) or nothing is to wait for."""
    device = torch.device(device)
    if device.type != "cuda" or _off is not None or (new and mode() != "process"):
        return None
    visible = _visible(device)
    with _lock:
        joined = {_running[(visible, v)] for v in variants if (visible, v) in _running}
        rest = tuple(sorted(v for v in set(variants) if (visible, v) not in _running)) if new else ()
        if rest:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
            env["PYTHONPATH"] = os.pathsep.join(x for x in (_package_root(), env.get("PYTHONPATH")) if x)
            stderr = tempfile.TemporaryFile()
            try:
                process = subprocess.Popen(command(), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                           stderr=stderr, env=env, close_fds=True)
                process.stdin.write(json.dumps([list(v) for v in rest]).encode())
                process.stdin.close()
            except OSError as error:
                stderr.close()
                _turn_off(f"cannot start a compile child: {error}")
                return None
            child = _Child(process, rest, stderr)
            _children.append(child)
            for variant in rest:
                _running[(visible, variant)] = child
            joined.add(child)
    return Batch(tuple(joined)) if joined else None


def _ended(child: _Child) -> None:
    """A child ended: its variants are no longer running; a bad end turns children off."""
    with _lock:
        for key in [k for k, c in _running.items() if c is child]:
            del _running[key]
        if child in _children:
            _children.remove(child)
            child.stderr.close()
    if child.error is not None:
        _turn_off(f"a compile child failed ({child.error})")


def _turn_off(reason: str) -> None:
    global _off
    if _off is None:
        _off = reason
        log.warning("%s; pack kernels compile in this process from now on (NEREUS_PACK_COMPILE)", reason)


def _kill_children() -> None:
    """At exit: a child left compiling only fills a cache nobody will read now."""
    for child in list(_children):
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def _after_fork_in_child() -> None:
    """A forked process did not start its parent's children and must not wait for them."""
    global _lock
    _lock = threading.Lock()
    _running.clear()
    _children.clear()


atexit.register(_kill_children)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def main() -> int:
    """The child: stdin is a JSON list of variants; each is compiled into Triton's cache.
    Exit status 0 when all were (an error's traceback goes to stderr)."""
    variants = [tuple(v) for v in json.loads(sys.stdin.read())]
    from . import kernels

    for variant in variants:
        kernels.compile_only(variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
