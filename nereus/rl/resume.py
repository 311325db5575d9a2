"""Resume a run from its latest complete checkpoint, in any plan of the file and on any
process count that plan fits (`nereus train --resume OUT [--plan P] [--nproc N]`).

Input: the runtime, already in the plan to resume in, the module and a checkpoint
directory (nereus.rl.checkpoint). Output: every saved model-stage registered in the
runtime with this rank's shards of the new layout, read straight from the checkpoint's
files (nereus.rl.checkpoint_read), and the trainer state the checkpoint carries.
Invariant: each rank reads exactly the boxes of its own new shards (`Runtime.layout`:
the compiler's layout of any plan), whatever layout and process count wrote them; no
rank assembles a full tensor; what it reads is what the new layout holds (reported as
`bytes_read` against `layout_bytes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nereus.backends.json_program import plan_units_json
from nereus.runtime.boxes import as_box, shard_shape
from nereus.runtime.state import box_piece, step_name, unit_on_gpu

from .checkpoint import plan_name, saved_stages
from .checkpoint_read import ReadCount, read_boxes


def empty_shards(rt, module, ms: str, rank: int, wanted: dict) -> dict:
    """This rank's shards of `ms` in the runtime's plan, allocated (CPU) and not yet
    filled; each box's view goes into `wanted` under the checkpoint's name for it."""
    unit = unit_on_gpu(plan_units_json(module, plan_name(rt), ms), rank)
    specs = rt.tensor_specs(ms)
    local = {}
    if unit is None:
        return local
    for shard in unit["shards"]:
        if shard["gpu"] != rank:
            continue
        name = shard["tensor"]
        boxes = [as_box(b) for b in shard["boxes"]]
        local[name] = torch.empty(shard_shape(boxes), dtype=specs[name][1])
        for index, box in enumerate(boxes):
            wanted[(f"{ms}/{name}", tuple(lo for lo, _ in box))] = (box, box_piece(local[name], boxes, index))
    return local


def load_checkpoint(rt, module, path: str) -> tuple[dict, ReadCount, int]:
    """Collective: register every saved model-stage from the checkpoint at `path` (module
    docstring). Returns (the trainer state, the bytes this rank read, the bytes of its
    new shards)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    wanted: dict = {}
    shards = {ms: empty_shards(rt, module, ms, rank, wanted) for ms in saved_stages(module)}
    state, count = read_boxes(path, wanted, distributed=dist.is_initialized())
    layout_bytes = sum(t.numel() * t.element_size() for local in shards.values() for t in local.values())
    for ms, local in shards.items():
        local = {name: tensor.to(rt.device) for name, tensor in local.items()}
        counter = state["adam_steps"].get(ms)
        if local and counter is not None and counter >= 0:
            local[step_name(ms.partition(".")[0])] = torch.tensor(counter, dtype=torch.int64)
        rt.register(ms, local)
    return state, count, layout_bytes


def generation_shards(rt, module) -> None:
    """Register actor.generation's shards (allocated; the weight sync fills them)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    local = empty_shards(rt, module, "actor.generation", rank, {})
    rt.register("actor.generation", {name: tensor.to(rt.device).zero_() for name, tensor in local.items()})
