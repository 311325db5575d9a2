"""Live EMU state: the local shards of one rank, built from and gathered to full tensors.

The layouts come from the compiler as JSON UNIT dicts (`units` of a JSON program, or
`plan_units_json` for a plan without a transition). Local shard contract (see
`boxes.py`): the local tensor of (unit, GPU, tensor) is its boxes' slices of the full
tensor concatenated along dim 0, in the listed order.

Training units also hold fp32 optimizer state under `{tensor}#master|exp_avg|exp_avg_sq`
(sharded like the weight) and the Adam step counter, which the runtime keeps as one
int64 scalar named STEP_NAME(model) and replicates to every holder.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError

from .boxes import Box, as_box, box_numel
from .executor import TORCH_DTYPES


def step_name(model: str) -> str:
    """Name of a training model-stage's Adam step counter (an int64 scalar)."""
    return f"{model}/#step"


def box_view(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def shard_of(full: torch.Tensor, boxes) -> torch.Tensor:
    """The local tensor of a shard: its boxes of `full` stacked along dim 0 (a new tensor)."""
    boxes = [as_box(b) for b in boxes]
    if full.dim() == 0:
        return full.clone()
    parts = [box_view(full, b) for b in boxes]
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0].clone()


def unit_on_gpu(units: list, gpu: int, model_stage: Optional[str] = None) -> Optional[dict]:
    """The UNIT dict placed on `gpu` (of `model_stage` when given), or None."""
    for unit in units:
        if (model_stage is None or unit["model_stage"] == model_stage) and gpu in unit["gpus"]:
            return unit
    return None


def shard_unit(unit: dict, gpu: int, full: dict, device=None) -> dict:
    """Input: a UNIT dict, a GPU of it, and full tensors by global name.
    Output: {global name: local tensor} of every shard the unit holds on that GPU.
    Raises NereusError naming the first tensor missing from `full` or with a wrong shape."""
    out = {}
    for shard in unit["shards"]:
        if shard["gpu"] != gpu:
            continue
        name = shard["tensor"]
        if name not in full:
            raise NereusError(f"the state dict lacks {name}, which unit {unit['id']} holds",
                              hint="tensor_specs(model_stage) lists every name a full state dict needs")
        tensor = full[name]
        if tensor.dim() != len(shard["boxes"][0]) or any(
                hi > tensor.shape[d] for b in shard["boxes"] for d, (_, hi) in enumerate(b)):
            raise NereusError(f"{name} has shape {tuple(tensor.shape)}, too small for the boxes {shard['boxes']}")
        local = shard_of(tensor, shard["boxes"])
        out[name] = local.to(device) if device is not None else local
    return out


def writers(units: list) -> dict:
    """For each tensor, the (gpu, boxes index) that writes each distinct box when the
    units' shards are assembled into full tensors: the first holder in unit order.

    Output: {tensor: [(gpu, box index in that shard), ...]}; identical boxes held by
    several GPUs (replicated tensors, DP replicas, replicated KV heads) appear once."""
    seen: dict = {}
    out: dict = {}
    for unit in units:
        for shard in unit["shards"]:
            for i, raw in enumerate(shard["boxes"]):
                box = as_box(raw)
                key = (shard["tensor"], box)
                if key not in seen:
                    seen[key] = (shard["gpu"], i)
                    out.setdefault(shard["tensor"], []).append((shard["gpu"], i, box))
    return out


def box_piece(local: torch.Tensor, boxes, index: int) -> torch.Tensor:
    """Box `index` of a local shard (its boxes stacked along dim 0), as a view."""
    if local.dim() == 0:
        return local
    offset = sum(b[0][1] - b[0][0] for b in boxes[:index])
    return local[offset: offset + boxes[index][0][1] - boxes[index][0][0]]


def gather_to_root(full: Optional[torch.Tensor], entries, local: Optional[torch.Tensor], boxes, rank: int,
                   group=None) -> None:
    """Collective over rank 0 and the ranks named in `entries` (`writers(units)[name]` of
    one tensor): every box is sent to rank 0 and written into `full` there (None on the
    other ranks). `local` and `boxes` are this rank's shard of the tensor. This is the
    first half of the gather-then-scatter baseline the benchmarks compare against."""
    ops, pending = [], []
    for holder, index, box in entries:
        if holder == rank:
            part = box_piece(local, boxes, index)
            if rank == 0:
                box_view(full, box).copy_(part)
            else:
                ops.append(dist.P2POp(dist.isend, part.contiguous(), 0, group))
        elif rank == 0:
            buf = torch.empty([hi - lo for lo, hi in box], dtype=full.dtype, device=full.device)
            ops.append(dist.P2POp(dist.irecv, buf, holder, group))
            pending.append((box, buf))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for box, buf in pending:
        box_view(full, box).copy_(buf)


def assemble(units: list, gpu: int, local: dict, specs: dict, group=None) -> dict:
    """Collective over `group` (every rank calls it with its own GPU and local shards).

    Input: every UNIT of one model-stage, this rank's GPU and its local shards, and
    {name: (shape, torch dtype)} of the full tensors. Output: the full tensors on every
    rank, each element written by exactly one holder, summed bytewise across ranks.
    Raises NereusError when the layout does not cover a tensor exactly once."""
    write = writers(units)
    unit = unit_on_gpu(units, gpu)
    my_boxes = {}
    if unit is not None:
        for shard in unit["shards"]:
            if shard["gpu"] == gpu:
                my_boxes[shard["tensor"]] = [as_box(b) for b in shard["boxes"]]
    out = {}
    for name, (shape, dtype) in specs.items():
        if name not in write:
            continue
        numel = 1
        for d in shape:
            numel *= d
        if sum(box_numel(box) for _, _, box in write[name]) != numel:
            raise NereusError(f"the layout does not cover {name} exactly once")
        full = torch.zeros(shape, dtype=dtype)
        for holder, index, box in write[name]:
            if holder == gpu:
                box_view(full, box).copy_(box_piece(local[name], my_boxes[name], index).cpu())
        flat = full.reshape(-1).view(torch.uint8) if full.dim() else full.reshape(1).view(torch.uint8)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        out[name] = full
    return out


def specs_nbytes(specs: dict) -> int:
    total = 0
    for shape, dtype in specs.values():
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=dtype).element_size()
    return total


__all__ = ["TORCH_DTYPES", "assemble", "box_piece", "box_view", "gather_to_root", "shard_of", "shard_unit", "specs_nbytes", "step_name",
           "unit_on_gpu", "writers"]
