"""Progress of a long command on stderr (`nereus simulate`, `nereusc verify`, `nereusc
search`); stdout keeps the result, or the one JSON object of `--json`."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Optional

import click


class StderrProgress:
    """A callable `(phase, done, total)` that prints `  [label: ]phase done/total (elapsed)`
    at most every `every` seconds and at each phase's end; only from `after` seconds on,
    unless stderr is a terminal (a short run prints nothing into a log). `clock`, `echo`
    and `tty` replace the wall clock, stderr and its terminal test (tests)."""

    def __init__(self, label: Optional[str] = None, after: float = 0.0, every: float = 2.0,
                 clock: Callable[[], float] = time.perf_counter, echo: Optional[Callable[[str], None]] = None,
                 tty: Optional[bool] = None):
        self.label, self.after, self.every, self.clock = label, after, every, clock
        self.echo = echo or (lambda text: click.echo(text, err=True))
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.began = clock()
        self.last = -math.inf

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        elapsed = now - self.began
        if elapsed < self.after and not self.tty:
            return
        if done == total or now - self.last >= self.every:
            self.last = now
            what = f"{self.label}: {phase} {done}/{total}" if self.label else f"{phase}: {done}/{total}"
            self.echo(f"  {what} ({elapsed:.0f} s)")
