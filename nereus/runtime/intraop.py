"""One intra-op thread for the calling thread alone: torch's OpenMP-parallel CPU operators
that this thread runs from then on stay on it, while the job's own threads keep their
intra-op threads (MKL's and oneDNN's own thread counts are left alone: the replay tables
use neither).

Why: the lowering-ahead thread builds its replays' launch tables with torch operators on
CPU tensors of 10^4-10^5 rows, which torch spreads over an OpenMP team as wide as the
machine. Beside a main thread busy building the job's state (one H200 host, 16 cores, the
6-layer Qwen3-30B-A3B change, benchmarks/multi_gpu/thread_steps.py), the slowest replay
build of a run took 0.86-1.98 s of the thread's own CPU time with that team (6 runs),
0.16-0.25 s on one intra-op thread (2 runs), 0.22 s with OMP_NUM_THREADS=1 for the whole
process; with nothing beside it, 0.13-0.27 s with the team (4 runs) and 0.14 s on one
thread (1 run) (benchmarks/RESULTS.md, session 20). The time is the thread's own CPU in
user mode, not waiting for the GIL nor for the upload. The likely cause (not traced): the
team's threads fall asleep while the two threads hand the GIL back and forth (every 0.5 ms
while a step runs: nereus.runtime.ahead), and each operator then spins until its team is
awake again.

How: OpenMP keeps the team size per thread (the `nthreads-var` of each thread's own data
environment), and torch reads it back (`torch.get_num_threads()` is `omp_get_max_threads()`
once a thread's first operator has initialised it). `torch.set_num_threads` would also set
the process-wide value that every thread started afterwards begins with, so this calls
`omp_set_num_threads` of the OpenMP runtime torch is linked with directly: looked up
through torch's own library first (its dependencies: the runtime it links, even where
another package maps a copy of its own), then among the process's mapped OpenMP
libraries; the first whose call shows in `torch.get_num_threads()` is kept. Where torch's
parallel backend is not OpenMP, or no runtime answers, nothing changes."""

from __future__ import annotations

import ctypes
import os
import re
import threading
from typing import Callable, Iterator

import torch

# the OpenMP runtimes torch builds link: GNU (its wheels on Linux), LLVM, Intel
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|omp|iomp5)[-.][^/]*so[^/]*$")
_found: dict = {}  # "setter": the omp_set_num_threads that worked, or None (none did)
_lock = threading.Lock()


def openmp_backend() -> bool:
    """Whether torch's CPU operators run on OpenMP (the backend with a team size per thread)."""
    backend = torch.__config__.parallel_info().split("ATen parallel backend:")[-1].split("\n")[0]
    return "OpenMP" in backend


def one_intraop_thread() -> bool:
    """Make torch's CPU operators run on the calling thread alone, for this thread only;
    True where that holds afterwards (`torch.get_num_threads() == 1` in this thread).
    Cheap once the runtime is found: callers may repeat it (a library's own first use
    on this thread may set the team size again)."""
    if torch.get_num_threads() == 1:  # (torch's per-thread first use sets it: before ours)
        return True
    with _lock:
        if "setter" in _found:
            setter = _found["setter"]
            if setter is not None:
                setter(1)
            return torch.get_num_threads() == 1
        for setter in _setters():
            setter(1)
            if torch.get_num_threads() == 1:
                _found["setter"] = setter
                return True
        _found["setter"] = None
        return False


def _setters() -> Iterator[Callable[[int], None]]:
    """Candidates for the `omp_set_num_threads` torch's operators obey, most likely first:
    through torch's CPU library (a symbol lookup there searches what it links), then each
    mapped OpenMP library (Linux's /proc/self/maps). None where the backend is not OpenMP."""
    if not openmp_backend():
        return
    paths = [os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")]
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps if _OPENMP_LIBRARY.search(line.rstrip())})
    except OSError:
        pass
    for path in paths:
        try:
            function = ctypes.CDLL(path).omp_set_num_threads  # mapped already: the same handle
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], None
        yield function
