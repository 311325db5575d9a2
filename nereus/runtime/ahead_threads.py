"""What the lowering-ahead threads of one process share (nereus.runtime.ahead has one per
runtime): the set of live threads, pausing every one of them (`paused_all`: a transition
of one runtime, or a weight sync, beside another runtime's thread), the GIL's switch
interval while any of their steps runs, and the state a forked child must not inherit.

    register(ahead) / unregister(ahead)   # an Ahead's thread starts / ends
    with paused_all(): ...                # no step of any thread runs in the block
    with short_switch(): ...              # around one step (NEREUS_AHEAD_SWITCH_MS)

Invariant: a block under `paused_all` runs beside no step of any other thread of the
process, and an interrupted wait leaves none of them paused; the switch interval is
lowered only while at least one step runs and restored after the last one (unless the job
set another meanwhile).
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from contextlib import contextmanager

from nereus.ir.diagnostics import env_number

_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # those whose thread runs (it takes itself out)
_LIVE_LOCK = threading.Lock()  # (a WeakSet copied while another thread adds to it raises)


def register(ahead) -> None:
    """`ahead`'s thread runs: paused_all pauses it too (held weakly)."""
    with _LIVE_LOCK:
        _LIVE.add(ahead)


def unregister(ahead) -> None:
    """`ahead`'s thread ends (its last act)."""
    with _LIVE_LOCK:
        _LIVE.discard(ahead)


# The GIL's switch interval while a step runs (NEREUS_AHEAD_SWITCH_MS; 0: left as it is).
# Why: a step is Python (the execution plan, the replays' tables) and the training loop
# beside it gives up the GIL at every call that releases it (a kernel launch, a copy); it
# then waits for the step to give it back, up to the interval each time (5 ms by default).
SWITCH_S = env_number("NEREUS_AHEAD_SWITCH_MS", 0.5, 0.0, float) / 1e3
_switch = {"lock": threading.Lock(), "steps": 0, "saved": None, "set": None}


@contextmanager
def short_switch():
    """sys.setswitchinterval(SWITCH_S) while any runtime's step runs (never raised above
    what it was), the interval found before restored after the last one ends (unless the
    job set another meanwhile)."""
    if SWITCH_S <= 0:
        yield
        return
    with _switch["lock"]:
        if _switch["steps"] == 0:
            _switch["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_S, _switch["saved"]))
            _switch["set"] = sys.getswitchinterval()  # (whole microseconds: not always what was asked)
        _switch["steps"] += 1
    try:
        yield
    finally:
        with _switch["lock"]:
            _switch["steps"] -= 1
            if _switch["steps"] == 0 and sys.getswitchinterval() == _switch["set"]:
                sys.setswitchinterval(_switch["saved"])  # (one the job set meanwhile is its own)


def paused_all():
    """No step of any lowering-ahead thread of this process runs while the block runs
    (entering waits for the steps in progress): a transition of one runtime, or a weight
    sync, beside another runtime's thread would share the GIL with its steps."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    # (called from a step, its own thread would wait for itself)
    return pausing([a for a in live if a._thread is not threading.current_thread()])


@contextmanager
def pausing(aheads: list):
    """Every thread of `aheads` held before any step in progress is waited for (held one
    by one, a thread would go on stepping while another's step is waited for); an
    interrupted wait leaves none of them paused."""
    held = []
    try:
        for ahead in aheads:
            ahead._hold()
            held.append(ahead)
        for ahead in held:
            ahead._wait_step()
        yield
    finally:
        for ahead in held:
            ahead._release()


def _after_fork_in_child() -> None:
    global _LIVE_LOCK
    _LIVE_LOCK = threading.Lock()  # (perhaps held by a parent's thread at the fork)
    for ahead in list(_LIVE):
        ahead._after_fork_in_child()
    if _switch["steps"]:  # forked in the middle of a step: the child has no step running
        sys.setswitchinterval(_switch["saved"])
    _switch.update(lock=threading.Lock(), steps=0, saved=None, set=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
