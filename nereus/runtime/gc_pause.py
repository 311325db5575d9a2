"""Python's cyclic garbage collector paused while a transition or a weight sync runs.

A full collection scans every tracked object of the process: the runtime's cached
programs (their pieces, views and chunks), the registered tensors and the user's own
objects. On a rank of the 6-layer MoE benchmark that is ~480,000 objects (~900,000
before the runtime kept its compiled parts as text) and 0.1-0.4 s, and a transition
allocates enough new long-lived objects (the new shards) to set one off every other
call or so; since every rank then waits for the stalled one at the next collective, one
rank's collection stalls them all. All a collection could free during a transition is
cyclic garbage, which reference counting leaves behind and the next automatic
collection after the call finds just the same; so `paused()` turns the collector off
for the call and back on after (also after an error). Measured on the CPU box and the
H200 machine's host (gloo, Qwen3-30B-A3B's counts on tiny dimensions): see
benchmarks/RESULTS.md, "GC pauses".

PAUSE_GC starts from the environment (NEREUS_PAUSE_GC=0: off) at import; the module
attribute is read at each call, so tools can flip it (benchmarks/multi_gpu/variants.py).
"""

from __future__ import annotations

import contextlib
import gc

from nereus.ir.diagnostics import env_flag

PAUSE_GC = env_flag("NEREUS_PAUSE_GC", True)


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
