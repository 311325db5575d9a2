"""Expert-parallel building blocks over a torch.distributed group: the all-to-all that
sends each routed token to the EP rank holding its expert (dispatch) and its result
back (combine), differentiable.

Input: rows of a [N, hidden] tensor, each with a destination EP rank. Output: on every
EP rank, the rows sent to it (dispatch), and after the experts ran, each row's result
back on its source rank in the source's original order (combine). Invariant: combine ∘
dispatch is the identity on row positions; the backward of each all-to-all is the
all-to-all with the splits swapped, so gradients flow back to the rows that produced them.

Both ends use `torch.distributed.all_to_all_single` with uneven splits, which NCCL and
gloo (ProcessGroupGloo::alltoall_base, CPU tensors) both implement; the per-destination
row counts are exchanged first by one all-to-all of EP-size int64 counts. An EpGroup of
size 1 makes both a no-op, so ep = 1 is plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EpGroup:
    """This rank's expert-parallel group: `ranks` are the group's global ranks in EP-rank
    order (gpu(r, p, e, t) for e = 0..size-1 at this rank's r, p, t; docs/ir.md's mesh
    order), `group` is None when size == 1. torch numbers a group's members by sorted
    global rank, so splits are laid out in that order through `ranks`."""

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None
    ranks: tuple[int, ...] = ()

    def group_rank(self) -> torch.Tensor:
        """[size] int64: the position in the group's numbering of each EP rank."""
        order = sorted(self.ranks)
        return torch.tensor([order.index(g) for g in self.ranks], dtype=torch.int64)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(out_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class Dispatch:
    """How one dispatch laid the rows out: `order` sorts the source rows by destination,
    `sent`/`received` are the row counts per group rank."""

    order: torch.Tensor
    sent: list
    received: list


def dispatch(x: torch.Tensor, destination: torch.Tensor, ep: EpGroup, *extra: torch.Tensor):
    """Send row j of x [N, ...] to EP rank destination[j]. Returns (rows received [M, ...],
    the same for each `extra` tensor (e.g. expert ids; no gradient), Dispatch)."""
    if ep.size == 1:
        everything = torch.arange(x.shape[0], device=x.device)
        return x, extra, Dispatch(everything, [x.shape[0]], [x.shape[0]])
    target = ep.group_rank().to(destination.device)[destination]
    order = torch.argsort(target, stable=True)
    # the counts stay on x's device: NCCL moves CUDA tensors only (gloo, CPU ones)
    sent_counts = torch.bincount(target, minlength=ep.size).to(torch.int64)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=ep.group)
    sent, received = sent_counts.tolist(), received_counts.tolist()
    rows = _AllToAll.apply(x[order], received, sent, ep.group)
    others = []
    for tensor in extra:
        out = tensor.new_empty((sum(received),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor[order].contiguous(), received, sent, group=ep.group)
        others.append(out)
    return rows, tuple(others), Dispatch(order, sent, received)


def combine(y: torch.Tensor, how: Dispatch, ep: EpGroup) -> torch.Tensor:
    """The inverse of `dispatch`: rows y [M, ...] (one per row received) go back to their
    sources, in each source's original row order [N, ...]."""
    if ep.size == 1:
        return y
    back = _AllToAll.apply(y, how.sent, how.received, ep.group)
    inverse = torch.empty_like(how.order)
    inverse[how.order] = torch.arange(how.order.numel(), device=how.order.device)
    return back[inverse]
