"""Stress check (not collected by pytest): run test_streams.py's spawned work N times and
count the runs whose processes died (the SIGABRT at gloo worker exit that a reference
cycle through the executor's frames caused under CPU load; see test_abort_cycles.py).

    PYTHONPATH=$PWD python tests/runtime/stress_streams.py 30   # two at once for load
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_streams  # noqa: E402
from runtime_helpers import spawn  # noqa: E402


def main(runs: int) -> int:
    failed = 0
    tensors = test_streams.tensor_list(test_streams.MODEL, training=True)
    for i in range(runs):
        started = time.time()
        try:
            results = spawn(test_streams._run, 2, tensors)
            problem = None if all(r is not None and r[0] == "ok" for r in results) else repr(results)[:300]
        except Exception as error:  # noqa: BLE001 - a dead process: counted, the loop goes on
            problem = f"{type(error).__name__}: {error}"
        failed += problem is not None
        print(f"run {i}: {'FAIL ' + problem if problem else 'ok'} ({time.time() - started:.1f} s)", flush=True)
    print(f"{failed} of {runs} runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 30))
