"""Run a Python script (a benchmark) with its full garbage collections timed.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/gc_probe.py SCRIPT [ARGS...]

Installs a `gc.callbacks` hook in each process that times every generation-2 (full)
collection, then runs SCRIPT as __main__ with ARGS. At exit, rank 0 prints one line to
stderr: `GC_PROBE {"full_collections": n, "full_seconds": total, "each_s": [...],
"tracked_objects": n}`. The figures are this process's: the other ranks collect on
their own schedule. Used for benchmarks/RESULTS.md, "GC pauses".
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import sys
import time

_started = [0.0]
_full: list = []


def _time(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    elif info["generation"] == 2:
        _full.append(time.perf_counter() - _started[0])


def _report() -> None:
    if os.environ.get("RANK", "0") == "0":
        figures = {"full_collections": len(_full), "full_seconds": round(sum(_full), 4),
                   "each_s": [round(s, 4) for s in _full], "tracked_objects": len(gc.get_objects())}
        print("GC_PROBE " + json.dumps(figures), file=sys.stderr, flush=True)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: gc_probe.py SCRIPT [ARGS...]")
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(script))  # the script's own imports (mg_common)
    gc.callbacks.append(_time)
    atexit.register(_report)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
