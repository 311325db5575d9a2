"""One intra-op thread for the calling thread alone: torch's CPU operators that this thread
runs from then on stay on it, while the job's own threads keep their intra-op threads.

Why: the lowering-ahead thread builds its replays' launch tables with torch operators on
CPU tensors of 10^4-10^5 rows, which torch spreads over an OpenMP team as wide as the
machine. Beside a main thread busy building the job's state (one H200 host, 16 cores, the
6-layer Qwen3-30B-A3B change, benchmarks/multi_gpu/thread_steps.py), the slowest replay
build of a run took 0.86-1.98 s of the thread's own CPU time with that team (6 runs),
0.16-0.25 s on one intra-op thread (2 runs), 0.22 s with OMP_NUM_THREADS=1 for the whole
process; with nothing beside it, 0.13-0.27 s with the team (4 runs) and 0.14 s on one
thread (1 run) (benchmarks/RESULTS.md, session 20). The time is the thread's own CPU in user mode, not waiting for the GIL: most likely
the team's threads fall asleep while the two threads hand the GIL back and forth (every
few milliseconds while a step runs: nereus.runtime.ahead), and each operator then spins
until its team is awake again.

How: OpenMP keeps the team size per thread (the `nthreads-var` of each thread's own data
environment), and torch reads it back (`torch.get_num_threads()` is `omp_get_max_threads()`
once a thread's first operator has initialised it). `torch.set_num_threads` would also set
the process-wide value that every thread started afterwards begins with, so this calls the
OpenMP runtime torch is linked with (found among the process's mapped libraries) directly.
Where torch's parallel backend is not OpenMP, or no OpenMP runtime is found, nothing
changes."""

from __future__ import annotations

import ctypes
import re
import threading
from typing import Optional

import torch

# the OpenMP runtimes torch builds link: GNU (its wheels on Linux), LLVM, Intel
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|omp|iomp5)[-.][^/]*so[^/]*$")
_found: dict = {}
_lock = threading.Lock()


def one_intraop_thread() -> bool:
    """Make torch's CPU operators run on the calling thread alone, for this thread only;
    True where that holds afterwards (`torch.get_num_threads() == 1` in this thread)."""
    torch.get_num_threads()  # torch's per-thread first use sets the team size: before ours
    library = _openmp()
    if library is None:
        return torch.get_num_threads() == 1
    library.omp_set_num_threads(1)
    return torch.get_num_threads() == 1


def _openmp() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime torch's operators use, or None (not OpenMP, not found)."""
    with _lock:
        if "library" not in _found:
            _found["library"] = _find()
        return _found["library"]


def _find() -> Optional[ctypes.CDLL]:
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1].split("\n")[0]:
        return None
    try:
        with open("/proc/self/maps") as maps:  # (Linux; elsewhere no per-thread setting is made)
            paths = sorted({line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line.rstrip())})
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)  # already mapped: the same handle, nothing loaded twice
        except OSError:
            continue
        if hasattr(library, "omp_set_num_threads"):
            library.omp_set_num_threads.argtypes = [ctypes.c_int]
            library.omp_set_num_threads.restype = None
            return library
    return None
