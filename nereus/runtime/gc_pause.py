"""Python's cyclic garbage collector paused while a transition or a weight sync runs.

A full collection scans every tracked object of the process: the runtime's cached
programs (their pieces, views and chunks), the registered tensors and the user's own
objects. On a MoE refit's rank that is close to a million objects and 0.1-0.4 s, and a
transition allocates enough new long-lived objects (the new shards) to set one off
every other call or so; since every rank then waits for the stalled one in the next
collective, one rank's collection stalls them all. During a transition the collector
could only find the transition's own short-lived objects, which reference counting
frees anyway, so `paused()` turns it off for the call and back on after (also after an
error); objects of a reference cycle made meanwhile are found by the next automatic
collection. Measured on the CPU box (gloo, Qwen3-30B-A3B's counts on tiny dimensions):
see benchmarks/RESULTS.md, "GC pauses".

PAUSE_GC (environment NEREUS_PAUSE_GC=0 to turn it off) is read at each call.
"""

from __future__ import annotations

import contextlib
import gc
import os

PAUSE_GC = os.environ.get("NEREUS_PAUSE_GC", "1") != "0"


@contextlib.contextmanager
def paused():
    """Collector off inside, restored to what it was on exit (a collector the caller had
    turned off stays off; nested uses keep it off until the outermost one exits)."""
    if not PAUSE_GC or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
