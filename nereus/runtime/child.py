"""A Python helper process beside a runtime process: its start and its two pipe ends.

Used by rank 0's prover (nereus.runtime.prover) and each rank's lowering process
(nereus.runtime.lowerer). The child runs `entry` (Python source: it imports its serve
loop and calls it with the two pipe descriptors, read then write); the parent talks to
it over multiprocessing Connections. The child finds nereus where this process did (an
editable install, PYTHONPATH, a checkout), not in its working directory first; its stdout
is discarded (a --json caller's last line stays its own; errors still reach stderr); it
runs in a session of its own (a Ctrl-C of the job's terminal is the job's to handle) and
ends when its input closes.

Invariant: the pipe ends and the process are closed once, by whoever holds them last (the
owner's finalizer), and never by a forked child of this process (a DataLoader worker),
which drops its copies of the ends without a word so that the helper still sees its
input close when the parent ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from typing import Optional


def _path_entries() -> list:
    """sys.path as strings (a PathLike entry is allowed there; a join of it is not)."""
    out = []
    for entry in sys.path:
        try:
            text = os.fsdecode(entry)
        except TypeError:
            continue
        if text:
            out.append(text)
    return out


_INHERITED: list = []  # in a forked child: the parent's helper processes (never waited on)


def entry(serve: str) -> str:
    """The child's source for a serve loop `serve` ("package.module:function"). With `-m`
    or `-c` Python puts the working directory first on sys.path, and PYTHONSAFEPATH (which
    stops that) is ignored before 3.11: a `nereus` folder there would shadow the one this
    process imported, so the entry drops it."""
    module, function = serve.split(":")
    return ("import sys\n"
            "if sys.path and sys.path[0] in ('', '.'):\n"
            "    del sys.path[0]\n"
            f"from {module} import {function}\n"
            f"{function}(int(sys.argv[1]), int(sys.argv[2]))\n")


class Ends:
    """The process and the parent's two pipe ends: what must be closed, once, by whoever
    holds them last (the owner's finalizer; never a forked child of this process)."""

    def __init__(self):
        self.process: Optional[subprocess.Popen] = None
        self.outbox = self.inbox = None
        self.raw: list = []  # pipe fds not wrapped in a Connection yet
        self.owner = os.getpid()

    def close(self) -> None:
        for end in (self.outbox, self.inbox):
            if end is not None:
                try:
                    end.close()
                except OSError:
                    pass
        for fd in self.raw:
            try:
                os.close(fd)
            except OSError:
                pass
        self.outbox = self.inbox = None
        self.raw = []
        process, self.process = self.process, None
        if process is not None and os.getpid() == self.owner and process.poll() is None:
            try:
                process.wait(timeout=1.0)  # it exits when its input closes
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def forget_in_child(self) -> None:
        """In a forked child (a DataLoader worker): drop the parent's pipe ends without a
        word to the helper, so that it still sees its input close when the parent ends."""
        for end in (self.outbox, self.inbox):
            if end is not None:
                try:
                    end.close()  # the fd, once; nothing is sent
                except OSError:
                    pass
        if self.process is not None:  # not this process's child: kept, so no warning at exit
            # Popen.__del__ warns "subprocess N is still running" for a child it created and
            # never waited for: this copy created none (the parent did), and whether its
            # __del__ ran before the interpreter's shutdown cleared the warning machinery
            # depended on timing (a loaded machine printed it)
            self.process._child_created = False
            _INHERITED.append(self.process)
        self.outbox = self.inbox = self.process = None
        self.raw = []

    def kill(self) -> None:
        """Kill the process now (it did not answer in time: `close` then waits for nothing)."""
        if self.process is not None and os.getpid() == self.owner and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def owned_by(owner) -> tuple:
    """(Ends, finalizer) for a helper that `owner` holds: the finalizer (called by the
    owner's close, else when the owner is collected, or at exit) closes the ends; a forked
    child of this process forgets them (Ends.forget_in_child)."""
    ends = Ends()
    finalizer = weakref.finalize(owner, ends.close)
    _LIVE.add(ends)  # (one fork hook for all: a hook per helper would stay registered for good)
    return ends, finalizer


_LIVE: "weakref.WeakSet[Ends]" = weakref.WeakSet()  # every Ends not collected yet


def _after_fork_in_child() -> None:
    for ends in list(_LIVE):
        ends.forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def start(serve: str, ends: Ends) -> None:
    """Start a helper running `serve` ("package.module:function", called with its read and
    write descriptors) into `ends` (its process, `outbox` and `inbox`). Raises what
    starting it raised, the ends closed."""
    try:
        to_child, from_parent = os.pipe()
        ends.raw += [to_child, from_parent]
        to_parent, from_child = os.pipe()
        ends.raw += [to_parent, from_child]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(_path_entries()), PYTHONSAFEPATH="1")
        ends.process = subprocess.Popen(
            [sys.executable, "-c", entry(serve), str(to_child), str(from_child)],
            pass_fds=(to_child, from_child), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            close_fds=True, start_new_session=True)
        for fd in (to_child, from_child):
            os.close(fd)
            ends.raw.remove(fd)
        ends.outbox, ends.inbox = Connection(from_parent, readable=False), Connection(to_parent, writable=False)
        ends.raw = []
    except BaseException:
        ends.close()
        raise
