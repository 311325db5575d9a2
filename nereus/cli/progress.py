"""Progress lines on stderr for commands that can take a while (`nereus simulate`,
`nereusc search`): stdout stays the answer (a table, `.nir` text or one JSON object)."""

from __future__ import annotations

import math
import time

import click


class StderrProgress:
    """Prints `phase done/total (elapsed)` to stderr at most every `every` seconds, and at
    each phase's end; nothing during the first `after` seconds (a command that finishes
    in a second or two says nothing)."""

    def __init__(self, every: float = 2.0, after: float = 0.0):
        self.every = every
        self.after = after
        self.began = time.perf_counter()
        self.last = -math.inf

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.began < self.after:
            return
        if done == total or now - self.last >= self.every:
            self.last = now
            click.echo(f"  {phase}: {done}/{total} ({now - self.began:.0f} s)", err=True)
