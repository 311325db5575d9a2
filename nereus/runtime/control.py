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
error on the others instead of a hang: `TransitionAborted` naming this rank and the
collective (the group is unusable after a gloo timeout: end the job).

Every collective also carries a tag of what this rank is doing: a hash of (source,
target, which agreement). Ranks that pair up in one collective while in different
places (different targets; a rank that raised outside the transition and started another
while the rest wait in the commit) see different tags and all raise `TransitionAborted`
naming each rank's place, instead of reading one another's numbers as their own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
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

    def __init__(self, failures: list, source: str, target: str, hint: Optional[str] = None):
        self.failures = failures
        text = "; ".join(str(f) for f in failures)
        super().__init__(f"{source} -> {target} rolled back on every rank: {text}",
                         hint=hint or "the old plan's state is intact and usable; fix the cause and retry")


@lru_cache(maxsize=256)
def tag(source: str, target: str, kind: str) -> int:
    """A stable tag of (source, target, kind) below 2**48 (exact in float64 rows; the
    same in every process, unlike hash())."""
    digest = hashlib.blake2b(f"{source}\0{target}\0{kind}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % ((1 << 48) - 1)


def _label(source: str, target: str, kind: str) -> str:
    return {"agree": f"a round agreement of {source} -> {target}",
            "first": f"the first agreement of {source} -> {target}",
            "commit": f"the commit of {source} -> {target}",
            "live": f"the start of {source} -> {target}",
            "compile": f"compiling {source} -> {target}",
            "prepare": f"prepare({target!r}) from {source}"}.get(kind, f"{kind} of {source} -> {target}")


@contextlib.contextmanager
def collectives(source: str, target: str, kind: str):
    """Around collectives of a transition (the control group's, before or in it): a
    RuntimeError raised inside torch.distributed (a peer timed out, exited or closed the
    connection) becomes TransitionAborted naming this rank; any other error passes."""
    try:
        yield
    except RuntimeError as error:
        if not _from_torch_distributed(error):
            raise
        me = dist.get_rank()
        raise TransitionAborted([Failure(me, -1, f"control collective at {_label(source, target, kind)}", None,
                                         f"{error}".strip())], source, target,
                                hint="a peer did not take part within the process group's timeout: it failed "
                                     "outside the transition, exited, or called something else. This rank's old "
                                     "state is intact, but the process group is unusable now: end the job") from None


def _from_torch_distributed(error: BaseException) -> bool:
    """Whether the innermost Python frame of `error` is torch.distributed's."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    name = frame.tb_frame.f_code.co_filename.replace(os.sep, "/") if frame is not None else ""
    return "/torch/distributed/" in name


class Stale(Exception):
    """Raised alike on every rank by an agreement whose rows show that what the transition
    was started from no longer holds (`agree`'s `fresh`); raised before any data moved."""


def agree(failure: Optional[Failure], group, source: str, target: str, row: Optional[tuple] = None,
          fresh: Optional[Callable[[list], bool]] = None, kind: str = "agree") -> Optional[list]:
    """Collective. Input: this rank's failure or None. Returns when no rank failed;
    otherwise raises TransitionAborted with every rank's failure on every rank.
    With `row` (ints; the same length on every rank) the one collective is an all_gather
    of [flag, *row] instead of an all_reduce of the flag, and every rank's row comes back
    ([[int] per rank]); when `fresh(rows)` is False every rank raises Stale (they all see
    the same rows), before any failure is looked at. `kind` names the step (its tag):
    "agree" in a round, "compile" before a program is compiled, "prepare" before
    `Runtime.prepare` warms the data links."""
    if row is None:
        # [flag, tag, -tag] under MAX: the tags agree iff max(tag) == -max(-tag)
        mine = tag(source, target, kind)
        flag = torch.tensor([0 if failure is None else 1, mine, -mine], dtype=torch.int64)
        with collectives(source, target, kind):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        top, bottom = int(flag[1]), -int(flag[2])
        if top != bottom:
            _desync(group, source, target, kind)
        if int(flag[0]) != 0:
            _abort(failure, group, source, target)
        return None
    rows = gather_flagged(failure, row, torch.int64, group, (source, target, "first"))
    if fresh is not None and not fresh([r[1:] for r in rows]):
        raise Stale()
    return _rows_or_abort(rows, failure, group, source, target)


def commit(failure: Optional[Failure], figures, group, source: str, target: str) -> list:
    """Collective, the last agreement of a transition: `agree` whose one all_gather also
    carries this rank's `figures` (floats; exact for integers below 2**53). Returns every
    rank's figures, [[float] per rank] in rank order, when no rank failed; otherwise
    raises TransitionAborted with every rank's failure on every rank (as `agree`)."""
    rows = gather_flagged(failure, [float(f) for f in figures], torch.float64, group, (source, target, "commit"))
    return _rows_or_abort(rows, failure, group, source, target)


def gather_flagged(failure: Optional[Failure], values, dtype, group, where: tuple) -> list:
    """Collective: every rank's [failure flag, *values] (one all_gather, which also
    carries the tag of `where` = (source, target, kind)), in rank order; raises
    TransitionAborted on every rank when the ranks' tags differ."""
    source, target, kind = where
    mine = torch.tensor([0 if failure is None else 1, tag(source, target, kind), *values], dtype=dtype)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with collectives(source, target, kind):
        dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()
    if len({r[1] for r in rows}) > 1:
        _desync(group, source, target, kind)
    return [[r[0], *r[2:]] for r in rows]


def _rows_or_abort(rows: list, failure: Optional[Failure], group, source: str, target: str) -> list:
    """Every rank's values when no flag is set; else the same TransitionAborted everywhere."""
    if any(r[0] for r in rows):
        _abort(failure, group, source, target)
    return [r[1:] for r in rows]


def _desync(group, source: str, target: str, kind: str) -> None:
    """Collective, after one collective showed different tags (every rank saw them):
    exchange where each rank is and raise the same TransitionAborted on every rank. A rank
    in a commit drops its new state there (the old one stands), so every rank is back in
    its old plan."""
    labels: list = [None] * dist.get_world_size(group)
    with collectives(source, target, kind):
        dist.all_gather_object(labels, _label(source, target, kind), group=group)
    failures = [Failure(rank, -1, "control", None, f"at {label}") for rank, label in enumerate(labels)]
    raise TransitionAborted(failures, source, target,
                            hint="the ranks were in different collectives: every rank must call transition() with "
                                 "the same target, and a rank whose call raised must not start another while the "
                                 "others still run theirs; every rank kept its old state")


def _abort(failure: Optional[Failure], group, source: str, target: str) -> None:
    """Collective, after a flag showed that some rank failed: exchange the failures and
    raise the same TransitionAborted on every rank."""
    gathered: list = [None] * dist.get_world_size(group)
    with collectives(source, target, "abort"):
        dist.all_gather_object(gathered, failure, group=group)
    raise TransitionAborted([f for f in gathered if f is not None], source, target)
