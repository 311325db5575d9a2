"""`zero 3` compute: weights gathered one layer at a time, gradients reduce-scattered.

    weights = LayerGather(chunks, shapes, dtype, device, replica=, dp=, group=, dp_ranks=)
    y = run_layers(model, weights, ...)          # a Mapping: layer i is gathered on first access

    weights = LayerGather(..., grad=True, before_reduce=hook)
    with weights.saving():                      # forward: nothing keeps a gathered layer alive
        loss = forward(model, weights, ...)
    loss.backward()                             # each layer re-gathered for its backward, its
    chunk_grads = weights.finish()              # gradients reduce-scattered to dp chunks

Input: this replica's dp chunks of a training unit's weights (`chunk_rows` of each local
TP/PP shard, the runtime's `zero 3` layout; a replica whose chunk is empty holds no
tensor) and the local shard shapes. Output: a Mapping from local weight names to the
whole local shards that the llama forward reads, each group of weights all-gathered over
the dp group when first read and dropped when another group is read; a group is one
layer (`layers.{i}.*`) or one tensor outside the layers (embed, final norm, heads).
With `grad`, `finish()` gives each weight's fp32 gradient chunk, summed over the dp group.

Design (FSDP's FULL_SHARD with reshard_after_forward=True, the default; Megatron's
distributed optimizer keeps whole weights and is `zero 1`): during the forward a gathered
layer is referenced only by this Mapping's one-group cache: the tensors autograd saves
for the backward are packed as (group, name, view geometry) by a saved-tensor hook and
re-gathered, one group at a time, when the backward unpacks them. So the peak holds one
layer's whole weights (two around a layer boundary of the backward) plus the chunks,
instead of a pipeline stage's whole weights; the price is a second all-gather per layer
in the backward (FSDP's reshard_after_forward=False, keeping the forward's layers for
the backward, trades that memory for one gather: not implemented). A layer's gradients
are summed over the dp group and cut to chunks by one reduce-scatter when its backward
ends (`reduce_scatter_chunks`), so no rank holds a stage's whole gradients either; the
tensors outside the layers (which a tied head reads twice) are reduced in `finish()`.

Invariant: every weight byte the forward and backward read equals what a zero 0 run
holds (gathers copy bytes), and each gradient chunk is the dp sum of the same per-replica
gradients as zero 0's all-reduce (the order of that sum is the collective's: bit-equal
for dp 2, a few ulps otherwise). Every rank of the dp group reads the groups in the same
order (the same stage of the same model), so the collectives match.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from nereus.passes.layout import chunk_rows

from .zero import gather_weight_chunks, padded_chunk


def group_of(name: str) -> str:
    """The gather group of a local weight name: `layers.{i}` or the name itself."""
    if name.startswith("layers."):
        return name[:name.index(".", 7)]
    return name


@dataclass(frozen=True)
class _Packed:
    """A saved tensor that is (a view of) a gathered weight: re-gathered on unpack."""

    group: str
    name: str
    size: tuple
    stride: tuple
    offset: int
    whole: bool


class _Gather(torch.autograd.Function):
    """Forward: a group's whole weights from the chunks (all-gather). Backward: the
    gradients go to the LayerGather (fp32 dp-summed chunks); the chunk leaves get None
    (autograd would cast a returned gradient to the weights' dtype, e.g. bf16)."""

    @staticmethod
    def forward(ctx, gather: "LayerGather", group: str, *leaves):
        # a weak reference: the gathered tensors' graph must not keep their LayerGather alive
        ctx.gather, ctx.group = weakref.ref(gather), group
        return tuple(gather._gathered(group))

    @staticmethod
    def backward(ctx, *grads):
        ctx.gather()._backward(ctx.group, grads)
        return (None, None) + (None,) * len(grads)


class LayerGather(Mapping):
    """Zero 3 weights of one model-stage, gathered per layer (module docstring)."""

    def __init__(self, chunks: dict[str, torch.Tensor], shapes: dict[str, tuple], dtype: torch.dtype, device, *,
                 replica: int, dp: int, group, dp_ranks: Sequence[int], grad: bool = False,
                 before_reduce: Optional[Callable[[dict], None]] = None):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.replica, self.dp, self.group, self.dp_ranks = replica, dp, group, tuple(dp_ranks)
        self.members: dict[str, list[str]] = {}
        for name in shapes:
            self.members.setdefault(group_of(name), []).append(name)
        # the autograd leaves: this replica's chunks (an empty chunk is a 0-row tensor)
        self.chunks = {}
        for name, shape in shapes.items():
            chunk = chunks.get(name)
            if chunk is None:
                chunk = torch.empty((0, *shape[1:]), dtype=dtype, device=device)
            self.chunks[name] = chunk.detach().requires_grad_(grad)
        self.grad, self.before_reduce = grad, before_reduce
        self.grads: dict[str, torch.Tensor] = {}  # fp32 dp-summed chunk gradients (finish)
        self._pending: dict[str, torch.Tensor] = {}  # whole gradients of groups not reduced yet
        self._current: tuple[Optional[str], dict] = (None, {})  # the forward's gathered group
        self._backward_current: tuple[Optional[str], dict] = (None, {})
        self._registry: dict[int, tuple[str, str, weakref.ref]] = {}
        # accounting for tests and reports: gathers, and whole weights alive at once
        self.gathers = 0
        self.live = 0
        self.peak_live = 0

    # -- Mapping ---------------------------------------------------------------------------

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        group = group_of(name)
        if self._current[0] != group:
            self._current = (None, {})  # drop the previous group before gathering the next
            if self.grad and torch.is_grad_enabled():
                names = self.members[group]
                fulls = _Gather.apply(self, group, *(self.chunks[n] for n in names))
                gathered = dict(zip(names, fulls))
            else:
                gathered = dict(zip(self.members[group], self._gathered(group)))
            for n, t in gathered.items():
                self._registry[id(t)] = (group, n, weakref.ref(t))
            self._current = (group, gathered)
        return self._current[1][name]

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    # -- gathering -------------------------------------------------------------------------

    def _gathered(self, group: str) -> list[torch.Tensor]:
        """The group's whole local shards, all-gathered from the replicas' chunks (new
        tensors, no autograd history). Collective over the dp group."""
        out = {}
        with torch.no_grad():
            for name in self.members[group]:
                shape = self.shapes[name]
                full = torch.empty(shape, dtype=self.dtype, device=self.device)
                lo, hi = chunk_rows(shape[0], self.dp, self.replica)
                if hi > lo:
                    full[lo:hi] = self.chunks[name]
                out[name] = full
            gather_weight_chunks(out, self.replica, self.dp, self.group, self.dp_ranks)
        self.gathers += 1
        for full in out.values():
            self.live += 1
            weakref.finalize(full, self._died)
        self.peak_live = max(self.peak_live, self.live)
        return list(out.values())

    def _died(self) -> None:
        self.live -= 1

    # -- saved tensors: pack gathered weights as references, re-gather on unpack -----------

    def saving(self):
        """Context for the forward: tensors autograd saves that are gathered weights (or
        views of them) are kept as references and re-gathered in the backward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        base = tensor._base if tensor._base is not None else tensor
        entry = self._registry.get(id(base))
        if entry is None or entry[2]() is not base:
            return tensor
        return _Packed(entry[0], entry[1], tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
                       tensor is base)

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if self._backward_current[0] != packed.group:
            self._backward_current = (None, {})
            self._backward_current = (packed.group, dict(zip(self.members[packed.group],
                                                             self._gathered(packed.group))))
        full = self._backward_current[1][packed.name]
        return full if packed.whole else full.as_strided(packed.size, packed.stride, packed.offset)

    # -- gradients -------------------------------------------------------------------------

    def _backward(self, group: str, grads) -> None:
        for name, grad in zip(self.members[group], grads):
            # accumulated in the weights' dtype, as autograd accumulates a leaf's gradient
            self._pending[name] = grad if name not in self._pending else self._pending[name] + grad
        if group.startswith("layers."):  # a layer is read once per forward: reduce it now
            self._reduce(self.members[group])

    def _reduce(self, names: list[str]) -> None:
        grads = {n: self._pending.pop(n).float() for n in names}
        if self.before_reduce is not None:
            self.before_reduce(grads)
        self.grads.update(reduce_scatter_chunks(grads, self.replica, self.dp, self.group, self.dp_ranks))

    def finish(self) -> dict[str, torch.Tensor]:
        """After the backward: reduce the groups outside the layers, drop every gathered
        tensor; {local name: fp32 dp-summed gradient chunk} (names with an empty chunk
        absent). A weight the backward gave no gradient (not read, or its output unused)
        gets a zero one, as a zero 0 leaf without `.grad` does in the trainer: every
        replica steps the same weights. Collective over the dp group."""
        for name, shape in self.shapes.items():
            if name not in self.grads and name not in self._pending:
                self._pending[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._reduce(sorted(self._pending))
        self._current = self._backward_current = (None, {})
        return self.grads


def reduce_scatter_chunks(grads: dict[str, torch.Tensor], replica: int, dp: int, group,
                          dp_ranks: Sequence[int]) -> dict[str, torch.Tensor]:
    """{name: rows chunk_rows(rows, dp, replica) of the dp sum of `grads[name]`} (names
    whose chunk is empty left out). One reduce-scatter over `group` of a flat buffer cut
    into dp equal segments, one per group rank: each weight's chunk padded to ceil(rows /
    dp) rows, as `gather_weight_chunks` pads them. A backend without reduce_scatter_tensor
    all-reduces the buffer and keeps this rank's segment: the same sums. Collective."""
    if dp == 1 or group is None:
        out = {}
        for name, grad in grads.items():
            lo, hi = chunk_rows(grad.shape[0], dp, replica)
            if hi > lo:
                out[name] = grad[lo:hi].clone()
        return out
    names = sorted(grads)
    order = dist.get_process_group_ranks(group)  # group rank k is global rank order[k]
    owners = [list(dp_ranks).index(rank) for rank in order]
    segments = [_padded_chunks(grads, names, owner, dp) for owner in owners]
    flat = torch.cat(segments)
    mine = torch.empty_like(segments[0])
    try:
        dist.reduce_scatter_tensor(mine, flat, group=group)
    except (RuntimeError, NotImplementedError):  # e.g. a gloo without reduce_scatter
        dist.all_reduce(flat, group=group)
        k = owners.index(replica)
        mine = flat[k * mine.numel():(k + 1) * mine.numel()]
    out, offset = {}, 0
    for name in names:
        grad = grads[name]
        lo, hi = chunk_rows(grad.shape[0], dp, replica)
        row = grad[:1].numel() if grad.shape[0] else 0
        if hi > lo:
            out[name] = mine[offset:offset + (hi - lo) * row].view((hi - lo, *grad.shape[1:])).clone()
        offset += -(-grad.shape[0] // dp) * row
    return out


def _padded_chunks(grads: dict[str, torch.Tensor], names: list[str], replica: int, dp: int) -> torch.Tensor:
    """Replica `replica`'s chunk rows of every gradient, flat, each padded with zeros to
    ceil(rows / dp) rows (equal segments for every replica; `zero.padded_chunk`)."""
    pieces = [padded_chunk(grads[name], replica, dp) for name in names]
    return torch.cat(pieces) if pieces else torch.zeros(0)
