"""The optimizer step on `zero 1` / `zero 3` state: each dp replica updates its chunk;
the replicas all-gather the weights.

Input: a training unit's local state under zero (nereus.passes.layout.zero_boxes, the
runtime's layout). Per weight: fp32 `#master`, `#exp_avg`, `#exp_avg_sq` holding only
rows [lo, hi) of the rank's local TP/PP shard, the dim-0 chunk `chunk_rows(rows, dp,
replica)` (torch.chunk: ceil(rows / dp) rows per chunk, the last ones short or empty; an
empty chunk is absent from the state). The weight itself (model dtype) is the whole local
shard under `zero 1`, the same chunk under `zero 3`. And the fp32 gradients of the whole
local shard, already summed over the dp group.

Output (in place): the chunk's Adam update (nereus.rl.optim.adam_step on rows [lo, hi));
under `zero 1` every replica's weight rows then overwritten with the owner's updated
bytes (`gather_weight_chunks`); under `zero 3` the weight chunk is updated and each layer
is gathered again when the next forward reads it.
Invariant: the weights every replica computes with are the same bytes, and equal what
`adam_step` on the whole (zero 0) state computes: Adam is elementwise, the gradients are
the same dp sums, and the all-gather copies bytes (no arithmetic), so a zero 1 or zero 3
run reproduces its zero 0 run bit for bit where the reduce-scatter sums in the
all-reduce's order (dp 2), and within a few ulps per step otherwise.

Gradients: each replica receives only its chunk of the dp sums, by one reduce-scatter
of padded flat chunks (`nereus.rl.zero3.reduce_scatter_chunks`: zero 1 after the
backward, zero 3 per layer inside it), half an all-reduce's traffic. The sums are those of
zero 0's all-reduce up to the collective's summation order (bit-equal at dp 2). Zero 3's
forward and backward gather one layer at a time (`nereus.rl.zero3.LayerGather`); the
weight sync, which reads whole shards, gathers a stage at once (`gathered_weights`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from nereus.models import optimizer_name, tensor_table
from nereus.passes.layout import chunk_boxes, chunk_rows  # the compiler's cut (zero_boxes), reused

from .optim import adam_step
from .shards import local_boxes

__all__ = ["chunk_boxes", "chunk_rows", "gather_weight_chunks", "gathered_weights", "local_weight_shapes",
           "padded_chunk", "zero_adam_step"]


@torch.no_grad()
def zero_adam_step(state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], names: Sequence[str], step: int,
                   lr: float, betas: tuple[float, float], eps: float, *, zero: int, replica: int, dp: int, group,
                   dp_ranks: Sequence[int]) -> None:
    """One Adam step on this replica's chunks of `state` (see the module docstring).
    `grads`: {name: fp32 gradient chunk, rows `chunk_rows` of the local shard, already
    summed over the dp group} (`nereus.rl.zero3.reduce_scatter_chunks`; a weight whose
    chunk is empty is absent); `names`: every weight of the unit (the same on every
    replica). Under zero 1 the weights are then all-gathered over `group` (the dp group;
    `dp_ranks[r]` is the global rank of replica r). Collective over `group` under zero 1."""
    views: dict[str, torch.Tensor] = {}
    for name in grads:
        if zero >= 3:
            views[name] = state[name]
        else:
            lo, hi = chunk_rows(state[name].shape[0], dp, replica)
            views[name] = state[name][lo:hi]
        for suffix in ("master", "exp_avg", "exp_avg_sq"):
            key = optimizer_name(name, suffix)
            views[key] = state[key]
    adam_step(views, grads, step, lr, betas, eps)  # zero 1: writes the weight rows through the views
    if zero < 3:
        gather_weight_chunks({name: state[name] for name in names}, replica, dp, group, dp_ranks)


def local_weight_shapes(model, role) -> dict[str, tuple[int, ...]]:
    """{global name: shape of the local TP/PP shard} of every weight `role` (nereus.rl.
    topology.Role) holds of `model`: its stage's layers, embed on the first stage, final
    norm and head on the last; boxes from nereus.rl.shards (the local shard contract)."""
    first, last = role.pipe.layers
    out = {}
    for spec in tensor_table(model):
        if spec.layer is not None:
            held = first <= spec.layer < last
        else:
            held = role.pipe.is_first if spec.role == "embed" else role.pipe.is_last
        if held:
            boxes = local_boxes(spec, role.tp.size, role.tp.rank)
            out[f"{model.name}/{spec.name}"] = (sum(b[0][1] - b[0][0] for b in boxes),
                                                *[hi - lo for lo, hi in boxes[0][1:]])
    return out


def gathered_weights(state: dict[str, torch.Tensor], shapes: dict[str, tuple], dtype: torch.dtype, device, *,
                     replica: int, dp: int, group, dp_ranks: Sequence[int]) -> dict[str, torch.Tensor]:
    """Zero 3: the whole local shard of every weight in `shapes` ({global name: local
    shape}, `local_weight_shapes`), all-gathered from the dp replicas' chunks in `state`
    (new tensors; `state` is not changed). Collective over `group`."""
    out = {}
    for name, shape in shapes.items():
        full = torch.empty(shape, dtype=dtype, device=device)
        lo, hi = chunk_rows(shape[0], dp, replica)
        if hi > lo:
            full[lo:hi] = state[name]
        out[name] = full
    gather_weight_chunks(out, replica, dp, group, dp_ranks)
    return out


def gather_weight_chunks(weights: dict[str, torch.Tensor], replica: int, dp: int, group,
                         dp_ranks: Sequence[int]) -> None:
    """All-gather over the dp group: every replica's chunk rows of each weight (in place).

    One message per step: each replica packs its chunks as bytes, each padded to the
    largest chunk, so every replica sends the same size; bytes travel unchanged."""
    if dp == 1 or group is None:
        return
    names = sorted(weights)
    mine = _pack(weights, names, replica, dp)
    parts = [torch.empty_like(mine) for _ in range(dp)]
    dist.all_gather(parts, mine, group=group)
    # parts come in group-rank order, which is the sorted global ranks, not replica order
    order = dist.get_process_group_ranks(group)
    for index, packed in enumerate(parts):
        owner = list(dp_ranks).index(order[index])
        if owner != replica:
            _unpack(weights, names, owner, dp, packed)


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[:1].numel() * tensor.element_size() if tensor.shape[0] else 0


def padded_chunk(tensor: torch.Tensor, replica: int, dp: int) -> torch.Tensor:
    """Rows `chunk_rows(rows, dp, replica)` of `tensor`, flat, zero-padded to ceil(rows /
    dp) rows: every replica's chunk of a tensor has the same size (the all-gather of the
    weights and the reduce-scatter of the gradients, nereus.rl.zero3, cut alike)."""
    row = tensor[:1].numel() if tensor.shape[0] else 0
    padded = torch.zeros(-(-tensor.shape[0] // dp) * row, dtype=tensor.dtype, device=tensor.device)
    lo, hi = chunk_rows(tensor.shape[0], dp, replica)
    if hi > lo:
        padded[:(hi - lo) * row] = tensor[lo:hi].reshape(-1)
    return padded


def _pack(weights: dict[str, torch.Tensor], names: list, replica: int, dp: int) -> torch.Tensor:
    pieces = [padded_chunk(weights[name], replica, dp).view(torch.uint8) for name in names]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)


def _unpack(weights: dict[str, torch.Tensor], names: list, owner: int, dp: int, packed: torch.Tensor) -> None:
    offset = 0
    for name in names:
        tensor = weights[name]
        lo, hi = chunk_rows(tensor.shape[0], dp, owner)
        row = _row_bytes(tensor)
        if hi > lo:
            rows = packed[offset:offset + (hi - lo) * row].clone().view(tensor.dtype).view((hi - lo, *tensor.shape[1:]))
            tensor[lo:hi].copy_(rows)
        offset += -(-tensor.shape[0] // dp) * row

