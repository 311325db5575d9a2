"""The hindsight oracle: the cheapest sequence of plans over a whole trace, transitions included.

Input: step_s [T, C] — the true seconds of step t under candidate plan c (inf where c does not
fit step t), transition_s [C, C] — the true seconds of moving from plan a to plan b (0 on the
diagonal), and the index of the plan the job starts on. Output: `OracleResult` with the least
total time Σ_t step_s[t, c_t] + Σ_t transition_s[c_{t−1}, c_t] over every sequence c_0..c_{T−1}
(c_{−1} = start), and one sequence that attains it.
Invariant: the total is ≤ that of every sequence drawn from the candidates, so ≤ every policy
whose plans are among them (the simulator puts every plan a policy ran in the set); brute
force over all C^T sequences agrees on small cases (tests/controller/test_oracle.py).

Dynamic programming over steps × candidates, O(T·C²) time in numpy, O(T·C) memory for the
back-pointers: best[c] after step t = step_s[t, c] + min_a (best[a] + transition_s[a, c]).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class OracleResult:
    total_s: float  # inf when no sequence runs every step
    path: tuple[int, ...]  # candidate index per step (empty when total_s is inf)
    step_s: float  # Σ of the path's step seconds
    transition_s: float  # Σ of the path's transition seconds
    transitions: int
    failed_at: Optional[int]  # first step no candidate fits (None when every step runs)


def dp_oracle(step_s: np.ndarray, transition_s: np.ndarray, start: int) -> OracleResult:
    """Least total time over all plan sequences (module docstring)."""
    step_s = np.asarray(step_s, dtype=float)
    transition_s = np.asarray(transition_s, dtype=float)
    steps, count = step_s.shape
    if transition_s.shape != (count, count):
        raise ValueError(f"transition_s must be {count}×{count}, got {transition_s.shape}")
    transition_s = transition_s.copy()
    np.fill_diagonal(transition_s, 0.0)  # staying costs nothing
    best = np.full(count, math.inf)
    best[start] = 0.0
    back = np.zeros((steps, count), dtype=np.int64)
    for t in range(steps):
        arrive = best[:, None] + transition_s  # [from, to]
        back[t] = np.argmin(arrive, axis=0)
        best = arrive[back[t], np.arange(count)] + step_s[t]
        if not np.isfinite(best).any():
            return OracleResult(math.inf, (), math.inf, math.inf, 0, t)
    last = int(np.argmin(best))
    path = [last]
    for t in range(steps - 1, 0, -1):
        path.append(int(back[t][path[-1]]))
    path.reverse()
    return _score(step_s, transition_s, start, tuple(path))


def _score(step_s: np.ndarray, transition_s: np.ndarray, start: int, path: tuple[int, ...]) -> OracleResult:
    run = float(sum(step_s[t, c] for t, c in enumerate(path)))
    previous = (start,) + path[:-1]
    moves = [(a, b) for a, b in zip(previous, path) if a != b]
    spent = float(sum(transition_s[a, b] for a, b in moves))
    return OracleResult(run + spent, path, run, spent, len(moves), None)


def brute_force_oracle(step_s: np.ndarray, transition_s: np.ndarray, start: int) -> OracleResult:
    """Every one of the C^T sequences (tests only: tiny T and C)."""
    step_s = np.asarray(step_s, dtype=float)
    steps, count = step_s.shape
    best: Optional[OracleResult] = None
    for path in itertools.product(range(count), repeat=steps):
        scored = _score(step_s, np.asarray(transition_s, dtype=float), start, path)
        if math.isfinite(scored.total_s) and (best is None or scored.total_s < best.total_s):
            best = scored
    return best if best is not None else OracleResult(math.inf, (), math.inf, math.inf, 0, 0)
