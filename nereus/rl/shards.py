"""Which rows/columns of a global tensor a TP rank holds: the local-shard contract.

A (unit, gpu, tensor)'s local tensor is the concatenation along dim 0 of its boxes
(docs/ir.md, "model"). For the llama table (nereus.models):

- column: dim 0 split into tp parts, part-wise for fused tensors, so a TP shard of qkv is
  [its q rows; its k rows; its v rows] and of gate_up [its gate rows; its up rows]. When a
  head-structured part has fewer groups than tp (kv_heads < tp), group t // (tp/groups) is
  replicated on tp/groups consecutive ranks (Megatron / vLLM).
- row: dim 1 split into tp parts (one box).
- vocab: dim 0 split into tp parts.
- replicated: whole.

These functions are the layout-independent reference the RL loop uses to check the
runtime's shards and to re-shard in memory (the restart baseline). Torch is imported
lazily by the functions that need tensors.
"""

from __future__ import annotations

from nereus.models import COLUMN, REPLICATED, ROW, VOCAB, TensorSpec

Box = tuple[tuple[int, int], ...]


def _split(lo: int, n: int, parts: int, index: int) -> tuple[int, int]:
    size = n // parts
    return lo + index * size, lo + (index + 1) * size


def local_boxes(spec: TensorSpec, tp: int, tp_rank: int) -> list[Box]:
    """Boxes (global half-open ranges per dim) of `spec` held by TP rank `tp_rank` of `tp`,
    in the order their rows are concatenated in the local tensor.

    Invariant: concatenating the boxes along dim 0 gives the local tensor's shape."""
    shape = spec.shape
    rest = tuple((0, d) for d in shape[1:])
    if spec.sharding == REPLICATED or tp == 1:
        return [tuple((0, d) for d in shape)]
    if spec.sharding == VOCAB:
        return [(_split(0, shape[0], tp, tp_rank),) + rest]
    if spec.sharding == ROW:
        return [((0, shape[0]), _split(0, shape[1], tp, tp_rank)) + rest[1:]]
    if spec.sharding != COLUMN:
        raise ValueError(f"unknown sharding {spec.sharding!r} of {spec.name}")
    boxes, offset = [], 0
    parts = spec.parts or ()
    if not parts:
        return [(_split(0, shape[0], tp, tp_rank),) + rest]
    for part in parts:
        if part.groups < tp:
            group = tp_rank // (tp // part.groups)
            boxes.append((_split(offset, part.rows, part.groups, group),) + rest)
        else:
            boxes.append((_split(offset, part.rows, tp, tp_rank),) + rest)
        offset += part.rows
    return boxes


def shard(full, spec: TensorSpec, tp: int, tp_rank: int):
    """This TP rank's local tensor of the full tensor `full` (a new contiguous tensor)."""
    import torch

    pieces = [full[tuple(slice(lo, hi) for lo, hi in box)] for box in local_boxes(spec, tp, tp_rank)]
    return torch.cat(pieces, dim=0).contiguous() if len(pieces) > 1 else pieces[0].clone().contiguous()


def owned_boxes(spec: TensorSpec, tp: int, tp_rank: int) -> list[tuple[int, Box]]:
    """(row offset in the local tensor, box) for the boxes this rank is the first holder
    of among ranks 0..tp-1: writing only these reassembles the full tensor exactly once."""
    earlier = {box for r in range(tp_rank) for box in local_boxes(spec, tp, r)}
    out, row = [], 0
    for box in local_boxes(spec, tp, tp_rank):
        if box not in earlier:
            out.append((row, box))
        row += box[0][1] - box[0][0]
    return out


def write_owned(full, local, spec: TensorSpec, tp: int, tp_rank: int) -> None:
    """Write the boxes of `local` that `tp_rank` owns into `full` (in place)."""
    for row, box in owned_boxes(spec, tp, tp_rank):
        rows = box[0][1] - box[0][0]
        full[tuple(slice(lo, hi) for lo, hi in box)] = local[row:row + rows]
