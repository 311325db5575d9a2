"""Tensor-parallel building blocks (Megatron-LM style) over a torch.distributed group.

- copy_to_tp / reduce_from_tp: the identity/all-reduce pair around column- and
  row-parallel linears (Shoeybi et al. 2019, "f" and "g").
- vocab_parallel_embedding: each rank looks up the ids of its vocab rows, zeros the rest,
  and the partial embeddings are summed.
- vocab_parallel_logprob: log p(target) from vocab-sharded logits without gathering them:
  max and sum-exp are all-reduced, gradient (onehot - softmax) stays local.
- gather_vocab: full logits on every TP rank (for layout-independent sampling), in TP-rank
  order whatever the GPU order of the group.

A TpGroup with size 1 makes every collective a no-op, so the tp=1 run is plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpGroup:
    """This rank's tensor-parallel group: `group` is None when size == 1.

    `ranks` are the group's global ranks in TP-rank order (the placement's mesh order,
    which may be descending: `tp 2 on 1, 0`). torch numbers a group's members by sorted
    global rank, so collectives whose result has an order (all-gather) are put back in
    TP-rank order through `ranks`; when empty, the members' TP ranks are exchanged."""

    size: int = 1
    rank: int = 0
    group: Optional[Any] = None
    ranks: tuple[int, ...] = ()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """[tensor of TP rank 0, ..., of TP rank size-1] (no gradient)."""
        if self.size == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        if self.ranks:
            group_rank = {g: i for i, g in enumerate(sorted(self.ranks))}
            return [parts[group_rank[g]] for g in self.ranks]
        # order unknown to this group: learn each member's TP rank (one tiny all-gather)
        # rather than assume the group's numbering is the TP order
        mine = torch.tensor([self.rank], device=tensor.device)
        tp_ranks = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(tp_ranks, mine, group=self.group)
        by_tp = sorted(range(self.size), key=lambda i: int(tp_ranks[i]))
        return [parts[i] for i in by_tp]

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel linear)."""
    return _CopyToTp.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel linear)."""
    return _ReduceFromTp.apply(x, tp) if tp.size > 1 else x


def vocab_range(vocab: int, tp: TpGroup) -> tuple[int, int]:
    per = vocab // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab: int, tp: TpGroup) -> torch.Tensor:
    """Embedding lookup with `weight` = this rank's rows [lo, hi) of the vocab."""
    if tp.size == 1:
        return torch.nn.functional.embedding(ids, weight)
    lo, hi = vocab_range(vocab, tp)
    outside = (ids < lo) | (ids >= hi)
    local = torch.where(outside, torch.zeros_like(ids), ids - lo)
    out = torch.nn.functional.embedding(local, weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, tp)


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, lo, tp):
        logits = logits.float()
        m = logits.max(dim=-1).values
        tp.all_reduce(m, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        tp.all_reduce(sum_exp)
        local = target - lo
        inside = (local >= 0) & (local < logits.shape[-1])
        index = torch.where(inside, local, torch.zeros_like(local))
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        picked = torch.where(inside, picked, torch.zeros_like(picked))
        tp.all_reduce(picked)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, inside)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, inside = ctx.saved_tensors
        onehot = torch.zeros_like(softmax)
        onehot.scatter_(-1, index.unsqueeze(-1), inside.unsqueeze(-1).to(softmax.dtype))
        return grad.unsqueeze(-1) * (onehot - softmax), None, None, None


def vocab_parallel_logprob(logits: torch.Tensor, target: torch.Tensor, vocab: int, tp: TpGroup) -> torch.Tensor:
    """log softmax(logits)[target] where `logits` holds this rank's vocab columns."""
    lo, _ = vocab_range(vocab, tp)
    return _VocabParallelLogProb.apply(logits, target, lo, tp)


def gather_vocab(logits: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """Full-vocab logits on every TP rank (no gradient)."""
    if tp.size == 1:
        return logits
    return torch.cat(tp.all_gather(logits), dim=-1)
