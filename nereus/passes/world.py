"""world: a transition's plans → the world its rank program states (header fields).

Input: a `Module` and the source / target plan names. Output: `TransitionWorld` — the
header a JSON program v1 of that transition must carry: `gpus` (id, node, mem_bytes,
capacity_bytes = mem × (1 − reserve)), `nodes` (host_mem_bytes), `tensors` of the
model-stages that move, their `units` before and after (layouts, tp, pp, offload),
`resident_bytes` of the untouched model-stages and their names. Invariant: derived from
the plans alone (layout boxes, feasibility's resident bytes, diff's notion of unchanged),
never from a program, so the verifier can check a program's header against it
(nereus.passes.verify_world) and the emitter writes the same units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nereus.ir.model import Model, Module, Placement
from nereus.ir.ranges import at_json

from .diff import diff_stage
from .feasibility import placement_resident_bytes
from .layout import family_entries, gpu_shards, ranged_gpu_shards, tensor_entries, unit_id, unit_states


def box_json(box) -> list[list[int]]:
    """A box as JSON program v1 writes it: [[lo, hi], ...] per dimension."""
    return [[lo, hi] for lo, hi in box]


def placement_units(model: Model, placement: Placement, ranged: bool = False) -> list[dict]:
    """UNIT dicts (id, model_stage, replica, gpus, shards) of every replica of `placement`
    (`ranged`: shards as JSON program v2 lists them, families with `at` ranges)."""
    return [unit_json(model, placement, r, ranged=ranged) for r in range(placement.dp)]


def unit_json(model: Model, placement: Placement, replica: int, only: Optional[dict] = None,
              ranged: bool = False) -> dict:
    """The UNIT dict of one replica; with `only` ({gpu: set of tensor names, or None for
    all}), just those shards (a rank program lists its own shards and the ones its
    messages touch). `ranged`: v2 shards, one per (family, `at`, boxes), and `only` names
    families."""
    shards = []
    for p in range(placement.pp):
        for t in range(placement.stage_width):
            g = placement.gpu_of(replica, p, t)
            if only is not None and g not in only:
                continue
            names = None if only is None else only[g]
            if ranged:
                for tensor, at, boxes in ranged_gpu_shards(model, placement, p, t, replica):
                    if names is None or tensor in names:
                        shard = {"gpu": g, "tensor": tensor}
                        if at:
                            shard["at"] = at_json(at)
                        shard["boxes"] = [box_json(b) for b in boxes]
                        shards.append(shard)
                continue
            shards.extend({"gpu": g, "tensor": tensor, "boxes": [box_json(b) for b in boxes]}
                          for tensor, boxes in gpu_shards(model, placement, p, t, replica)
                          if names is None or tensor in names)
    unit = {"id": unit_id(str(placement.model_stage), replica), "model_stage": str(placement.model_stage),
            "replica": replica, "gpus": list(placement.replica_gpus(replica)), "tp": placement.tp,
            "pp": placement.pp}
    if placement.ep != 1:  # experts whole on their EP rank (docs/program.md)
        unit["ep"] = placement.ep
    if placement.layout is not None:  # a mesh layout (docs/program.md): its dimensions
        unit["mesh"] = [[name, size] for name, size in placement.layout.dims]
    unit["offload"] = placement.offload
    if placement.zero:  # optimizer state chunked over the dp units (docs/program.md)
        unit["zero"] = placement.zero
        unit["dp"] = placement.dp
    unit["shards"] = shards
    return unit


@dataclass(frozen=True)
class TransitionWorld:
    gpus: tuple  # ({"id", "node", "mem_bytes", "capacity_bytes"}, ...)
    nodes: tuple  # ({"id", "host_mem_bytes"}, ...)
    tensors: tuple  # ({"name", "shape", "dtype"}, ...) of the model-stages that move
    moving: tuple  # (before placement, after placement) of each model-stage that moves
    resident_bytes: dict  # {"gpu": bytes} of untouched model-stages
    untouched: tuple  # names of the untouched model-stages

    def units(self, module: Module, side: str, ranged: bool = False) -> list[dict]:
        """UNIT dicts of the moving model-stages, `side` "before" or "after" (`ranged`: v2)."""
        out = []
        for before, after in self.moving:
            placement = before if side == "before" else after
            out.extend(placement_units(module.model(placement.model_stage.model), placement, ranged))
        return out


def tensors_json(model: Model, states: tuple[str, ...], ranged: bool = False):
    """The `tensors` entries of a model-stage's tensors: one per tensor (v1), or per family
    with its `indices` (v2, `ranged`)."""
    if not ranged:
        for tensor, shape, dtype in tensor_entries(model, states):
            yield {"name": tensor, "shape": list(shape), "dtype": dtype}
        return
    for fam, indices, shape, dtype in family_entries(model, states):
        entry = {"name": fam, "shape": list(shape), "dtype": dtype}
        if indices:
            entry["indices"] = [list(r) for r in indices]
        yield entry


def transition_world(module: Module, source: str, target: str, ranged: bool = False) -> TransitionWorld:
    """The header fields a program of `source` → `target` must carry (module docstring);
    `ranged`: as JSON program v2 states them (tensor families)."""
    cluster = module.cluster
    before_plan, after_plan = module.plan(source), module.plan(target)
    gpus = tuple({"id": g, "node": cluster.node_of(g), "mem_bytes": cluster.gpu.mem_bytes,
                  "capacity_bytes": cluster.usable_gpu_bytes} for g in range(cluster.num_gpus))
    nodes = tuple({"id": n, "host_mem_bytes": cluster.host_mem_bytes} for n in range(cluster.nodes))
    resident = [0] * cluster.num_gpus
    moving, untouched, tensors = [], [], {}
    for before in before_plan.placements:
        after = after_plan.placement(before.model_stage)
        name = str(before.model_stage)
        if diff_stage(before, after).unchanged:
            untouched.append(name)
            for g, b in placement_resident_bytes(module, before).items():
                resident[g] += b
            continue
        moving.append((before, after))
        model = module.model(before.model_stage.model)
        for entry in tensors_json(model, unit_states(model, name), ranged):
            tensors.setdefault(entry["name"], entry)
    return TransitionWorld(gpus, nodes, tuple(tensors.values()), tuple(moving),
                           {str(g): b for g, b in enumerate(resident)}, tuple(untouched))
