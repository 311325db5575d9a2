"""Agreement between ranks on a small control channel (a gloo group of its own).

Every rank calls `agree(error)` the same number of times per transition (once per
round before the data exchange) and `commit(error, figures)` once at the end. The fast
path is one collective: an all_reduce of a flag for `agree` (an all_gather of [flag,
row...] for the first agreement of a warm transition, which carries the runtime's
registration counts and Adam steps), an all_gather of [flag, figures...] for `commit`
(so the report's figures of every rank ride on the commit, with no collective of their
own); only when some rank failed do ranks exchange the failure
texts, so that every rank raises the same `TransitionAborted` naming the failing rank,
round, op and peer.
The gloo group is created with a timeout, so a rank that never arrives turns into an
error on the others instead of a hang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank."""

    rank: int
    round: int  # -1: before the first round; len(rounds): at the commit
    op: str  # e.g. "pack send to 3", "unpack recv from 1", "alloc actor.training/1"
    peer: Optional[int]
    message: str

    def __str__(self) -> str:
        peer = f", peer {self.peer}" if self.peer is not None else ""
        return f"rank {self.rank}, round {self.round}, {self.op}{peer}: {self.message}"


class TransitionAborted(NereusError):
    """A transition that failed on some rank; every rank's old state is intact."""

    kind = "transition aborted"

    def __init__(self, failures: list, source: str, target: str):
        self.failures = failures
        text = "; ".join(str(f) for f in failures)
        super().__init__(f"{source} -> {target} rolled back on every rank: {text}",
                         hint="the old plan's state is intact and usable; fix the cause and retry")


class Stale(Exception):
    """Raised alike on every rank by an agreement whose rows show that what the transition
    was started from no longer holds (`agree`'s `fresh`); raised before any data moved."""


def agree(failure: Optional[Failure], group, source: str, target: str, row: Optional[tuple] = None,
          fresh: Optional[Callable[[list], bool]] = None) -> Optional[list]:
    """Collective. Input: this rank's failure or None. Returns when no rank failed;
    otherwise raises TransitionAborted with every rank's failure on every rank.
    With `row` (ints; the same length on every rank) the one collective is an all_gather
    of [flag, *row] instead of an all_reduce of the flag, and every rank's row comes back
    ([[int] per rank]); when `fresh(rows)` is False every rank raises Stale (they all see
    the same rows), before any failure is looked at."""
    if row is None:
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) != 0:
            _abort(failure, group, source, target)
        return None
    rows = gather_flagged(failure, row, torch.int64, group)
    if fresh is not None and not fresh([r[1:] for r in rows]):
        raise Stale()
    return _rows_or_abort(rows, failure, group, source, target)


def commit(failure: Optional[Failure], figures, group, source: str, target: str) -> list:
    """Collective, the last agreement of a transition: `agree` whose one all_gather also
    carries this rank's `figures` (floats; exact for integers below 2**53). Returns every
    rank's figures, [[float] per rank] in rank order, when no rank failed; otherwise
    raises TransitionAborted with every rank's failure on every rank (as `agree`)."""
    rows = gather_flagged(failure, [float(f) for f in figures], torch.float64, group)
    return _rows_or_abort(rows, failure, group, source, target)


def gather_flagged(failure: Optional[Failure], values, dtype, group) -> list:
    """Collective: every rank's [failure flag, *values] (one all_gather), in rank order."""
    mine = torch.tensor([0 if failure is None else 1, *values], dtype=dtype)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).tolist()


def _rows_or_abort(rows: list, failure: Optional[Failure], group, source: str, target: str) -> list:
    """Every rank's values when no flag is set; else the same TransitionAborted everywhere."""
    if any(r[0] for r in rows):
        _abort(failure, group, source, target)
    return [r[1:] for r in rows]


def _abort(failure: Optional[Failure], group, source: str, target: str) -> None:
    """Collective, after a flag showed that some rank failed: exchange the failures and
    raise the same TransitionAborted on every rank."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, failure, group=group)
    raise TransitionAborted([f for f in gathered if f is not None], source, target)
