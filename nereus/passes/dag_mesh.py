"""dag for mesh layouts: one `tensors` model-stage's Repartition → alloc / keep / copy /
send / free records, for `dag.build_dag`.

Input: a StageInfo whose placements carry mesh layouts (each side one unit over its GPU
list, every tensor's boxes given by its rule: nereus.ir.mesh). Output: appended to the
DAG's lists, the same records the architecture models get: one `Alloc` per after GPU, one
`Free` per before GPU, and `Xfer`s over the table's single slot. Invariant (as `dag`'s):
every box of every after shard gets exactly one source that holds it; a shard identical on
the same GPU (same boxes, same memory) is a `keep`; a piece held by several before GPUs
(replicated) comes from the same GPU, else one of the same node, else the holders in
rotation, so that replicas share the load.
"""

from __future__ import annotations

from nereus.ir.model import Module

from .dag_records import Alloc, Free, Piece, Xfer
from .layout import box_volume, held_boxes, shard_bytes_table, slot_specs
from .sharded import _cut

KEEP, COPY, SEND = "keep", "copy", "send"
TABLE_SLOTS = (0, 1)  # a tensor table lives in slot 0 (nereus.models.table)


def build_mesh_stage(module: Module, index: int, info, allocs: list, frees: list, xfers: list) -> None:
    """Append the records of model-stage `info` (the `index`-th changed one); see the module docstring."""
    model, before, after, states = info.model, info.before, info.after, info.states
    specs = slot_specs(model)
    node_of = module.cluster.node_of
    element_bytes = info.element_bytes
    before_bytes, after_bytes = shard_bytes_table(model, before), shard_bytes_table(model, after)
    first = len(frees)
    frees.extend([None] * len(before.gpus))
    kept_from = [0] * len(before.gpus)
    position = {g: u for u, g in enumerate(before.gpus)}
    same_memory = before.offload == after.offload
    holders = [[(u, box) for u in range(len(before.gpus)) for box in held_boxes(s.spec, before, 0, u, states)]
               for s in specs]
    rotation: dict[tuple, int] = {}

    def choose(gpu: int, group: tuple) -> int:
        here = position.get(gpu)
        if here is not None and here in group:
            return here
        close = tuple(u for u in group if node_of(before.gpus[u]) == node_of(gpu))
        pool = close or group
        key = (pool, node_of(gpu)) if close else (pool,)
        turn = rotation.get(key, 0)
        rotation[key] = turn + 1
        return pool[turn % len(pool)]

    for a, gpu in enumerate(after.gpus):
        alloc = len(allocs)
        here = position.get(gpu) if same_memory else None
        kept: list = []
        by_source: dict[int, list] = {}
        for i, slot_spec in enumerate(specs):
            mine = held_boxes(slot_spec.spec, after, 0, a, states)
            if not mine:
                continue
            if here is not None and held_boxes(slot_spec.spec, before, 0, here, states) == mine:
                kept.extend(Piece(i, b) for b in mine)
                continue
            for box in mine:
                for cell, group in _cut(box, holders[i]):
                    by_source.setdefault(choose(gpu, group), []).append(Piece(i, cell))
        kept_bytes = 0
        if kept:
            elements = sum(box_volume(p.box) for p in kept)
            kept_bytes = elements * element_bytes
            kept_from[here] += kept_bytes
            xfers.append(Xfer(KEEP, index, alloc, first + here, gpu, gpu, TABLE_SLOTS, tuple(kept), kept_bytes,
                              (elements, 0, 0), states))
        for u in sorted(by_source):
            pieces = tuple(by_source[u])
            elements = sum(box_volume(p.box) for p in pieces)
            src = before.gpus[u]
            xfers.append(Xfer(COPY if src == gpu else SEND, index, alloc, first + u, src, gpu, TABLE_SLOTS, pieces,
                              elements * element_bytes, (elements, 0, 0), states))
        full = after_bytes[(0, 0, a)]
        allocs.append(Alloc(index, 0, (0, a), gpu, full - kept_bytes, full))
    for u, gpu in enumerate(before.gpus):
        full = before_bytes[(0, 0, u)]
        frees[first + u] = Free(index, 0, (0, u), gpu, full - kept_from[u], full)
