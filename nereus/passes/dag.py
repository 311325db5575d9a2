"""dag: Diff → TransitionDag of alloc / keep / copy / send / free ops.

Input: a `Diff` (from `diff`) and its `Module`. Output: a `TransitionDag` whose records are
ordered deterministically (model-stage in workload order, after-unit mesh order, before
pipeline stage, source group). Invariant: every box of every after-unit shard gets exactly
one source, a before-unit of the same model-stage that holds it; every after (unit, GPU)
has one `Alloc`, every before (unit, GPU) one `Free`; an `Xfer` reads one before shard
and writes one after shard.

Ops are symbolic: an `Xfer` covers a contiguous *slot range* (see `layout`) with one
pattern of pieces that all layers of the range share; layer names are expanded only at
emission. Sources are chosen per (after GPU, before pipeline stage, set of TP ranks that
hold the pieces): the same GPU first (a whole shard identical on the same GPU is a `keep`,
reused in place; a part is a local `copy`), then a GPU of the same node, then the before
replicas in rotation, so that replicas holding identical data share the load. Only units of
the same model-stage are sources (actor.training state never feeds actor.generation: the
weights can differ in dtype and freshness, and the optimizer state exists only in training).
Units of an `offload` model-stage hold their state in host memory at the step boundary
(before and after the transition); a keep needs both sides in the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from nereus.models import COLUMN, ROW, VOCAB
from nereus.ir.model import Model, Module, Placement

from .diff import Diff, StageDiff
from .feasibility import placement_resident_bytes
from .layout import (
    Box,
    bytes_per_element,
    shard_bytes,
    slot_counts,
    slot_specs,
    stage_slots,
    states_of,
    rank_boxes,
    box_volume,
)

KEEP, COPY, SEND = "keep", "copy", "send"
_KINDS = ("first", "layer", "last")


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of the tensor pattern `spec` (index into `slot_specs(model)`), repeated for
    every slot of the op's range that holds that pattern."""

    spec: int
    box: Box


@dataclass(frozen=True, slots=True)
class Alloc:
    stage: int  # index into TransitionDag.stages
    replica: int
    pos: tuple[int, int]  # (pp stage, tp rank)
    gpu: int
    bytes: int  # shard bytes minus bytes kept in place
    shard_bytes: int


@dataclass(frozen=True, slots=True)
class Free:
    stage: int
    replica: int
    pos: tuple[int, int]
    gpu: int
    bytes: int  # shard bytes minus bytes handed over in place (kept)
    shard_bytes: int


@dataclass(frozen=True, slots=True)
class Xfer:
    kind: str  # keep | copy | send
    stage: int
    alloc: int  # index of the destination Alloc
    free: int  # index of the source Free
    src_gpu: int
    dst_gpu: int
    slots: tuple[int, int]  # half-open slot range
    pieces: tuple[Piece, ...]
    bytes: int
    volumes: tuple[int, int, int]  # elements per slot of each kind (first, layer, last), one state


@dataclass(frozen=True)
class StageInfo:
    """A model-stage that changes: its model, both placements, its tensor states."""

    name: str
    model: Model
    before: Placement
    after: Placement
    states: tuple[str, ...]
    element_bytes: int
    diff: StageDiff


@dataclass(frozen=True)
class TransitionDag:
    module: Module = field(compare=False, repr=False)
    source: str
    target: str
    stages: tuple[StageInfo, ...]
    untouched: tuple[str, ...]  # model-stages whose placement does not change
    resident: tuple[int, ...]  # per GPU: bytes of untouched model-stages
    allocs: tuple[Alloc, ...]
    frees: tuple[Free, ...]
    xfers: tuple[Xfer, ...]


def split_dim(sharding: str) -> Optional[int]:
    return {COLUMN: 0, VOCAB: 0, ROW: 1}.get(sharding)


@lru_cache(maxsize=8192)
def tp_pieces(spec, tp_before: int, tp_after: int, rank_after: int, ep_before: int = 1,
              ep_after: int = 1) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """The after stage rank's boxes of `spec` cut into maximal pieces each held by one set
    of before stage ranks: ((piece box, holder ranks), ...). Pure, cached per mesh pair.
    An expert's tensor has holders only on its owning EP rank."""
    dim = split_dim(spec.sharding)
    every = tuple(t for t in range(tp_before * ep_before) if rank_boxes(spec, tp_before, ep_before, t))
    wanted = rank_boxes(spec, tp_after, ep_after, rank_after)
    if dim is None:
        return tuple((box, every) for box in wanted)
    held = [(t, b[dim]) for t in every for b in rank_boxes(spec, tp_before, ep_before, t)]
    out = []
    for box in wanted:
        lo, hi = box[dim]
        cuts = sorted({lo, hi} | {x for _, iv in held for x in iv if lo < x < hi})
        runs: list[list] = []
        for x, y in zip(cuts, cuts[1:]):
            holders = tuple(t for t, (a, b) in held if a <= x and y <= b)
            if runs and runs[-1][2] == holders:
                runs[-1][1] = y
            else:
                runs.append([x, y, holders])
        for x, y, holders in runs:
            out.append((box[:dim] + ((x, y),) + box[dim + 1:], holders))
    return tuple(out)


@lru_cache(maxsize=8192)
def kept_specs(model: Model, tp_before: int, rank_before: int, tp_after: int, rank_after: int,
               ep_before: int = 1, ep_after: int = 1) -> frozenset[int]:
    """Spec indices whose shard is identical for the two stage positions: reused in place."""
    return frozenset(i for i, s in enumerate(slot_specs(model))
                     if rank_boxes(s.spec, tp_before, ep_before, rank_before)
                     == rank_boxes(s.spec, tp_after, ep_after, rank_after))


@lru_cache(maxsize=8192)
def source_groups(model: Model, tp_before: int, tp_after: int, rank_after: int, kinds: tuple[str, ...],
                  skip: frozenset[int], ep_before: int = 1, ep_after: int = 1) -> tuple[tuple[tuple[int, ...], tuple[Piece, ...], tuple[int, int, int]], ...]:
    """Pieces an after TP rank needs from one before pipeline stage, grouped by the before
    TP ranks that hold them: ((holders, pieces, elements per slot kind), ...), specs in
    `skip` (kept in place) left out. Cached: identical for every replica and layer range."""
    groups: dict[tuple[int, ...], list] = {}
    for index, slot_spec in enumerate(slot_specs(model)):
        if index in skip or slot_spec.kind not in kinds:
            continue
        for box, holders in tp_pieces(slot_spec.spec, tp_before, tp_after, rank_after, ep_before, ep_after):
            entry = groups.setdefault(holders, [[], [0, 0, 0]])
            entry[0].append(Piece(index, box))
            entry[1][_KINDS.index(slot_spec.kind)] += box_volume(box)
    return tuple((h, tuple(p), tuple(v)) for h, (p, v) in sorted(groups.items()))


def _kinds(counts: dict[str, int]) -> tuple[str, ...]:
    return tuple(k for k in _KINDS if counts[k])


def _bytes(volumes: tuple[int, int, int], counts: dict[str, int], element_bytes: int) -> int:
    return (volumes[0] * counts["first"] + volumes[1] * counts["layer"] + volumes[2] * counts["last"]) * element_bytes


def build_dag(module: Module, diff: Diff) -> TransitionDag:
    """Lower every changed model-stage of `diff` into symbolic ops (see module docstring)."""
    num_gpus = module.cluster.num_gpus
    resident = [0] * num_gpus
    untouched = []
    stages: list[StageInfo] = []
    for sd in diff.stages:
        if sd.unchanged:
            untouched.append(sd.model_stage)
            for g, b in placement_resident_bytes(module, sd.before).items():
                resident[g] += b
            continue
        model = module.model(sd.before.model_stage.model)
        states = states_of(sd.model_stage)
        stages.append(StageInfo(sd.model_stage, model, sd.before, sd.after, states,
                                bytes_per_element(model, states), sd))
    allocs: list[Alloc] = []
    frees: list[Free] = []
    xfers: list[Xfer] = []
    for index, info in enumerate(stages):
        _build_stage(module, index, info, allocs, frees, xfers)
    return TransitionDag(module, diff.source, diff.target, tuple(stages), tuple(untouched), tuple(resident),
                         tuple(allocs), tuple(frees), tuple(xfers))


def _stage_recipe(model: Model, before: Placement, after: Placement, q: int, u: int,
                  here: Optional[tuple[int, int]], element_bytes: int) -> tuple[tuple, ...]:
    """What the after GPU at (pp stage q, tp rank u) needs, per before pipeline stage:
    ("keep", p, slots, pieces, bytes, ()) for shards identical on its own GPU (`here` is the
    (pp stage, tp rank) that GPU had before, or None) and ("pull", p, slots, pieces, bytes,
    holders) for each group of pieces held by the same before TP ranks. The same for every
    replica: computed once per (q, u, here)."""
    specs = slot_specs(model)
    lo, hi = stage_slots(model.layers, after.pp, q)
    out = []
    for p in range(before.pp):
        blo, bhi = stage_slots(model.layers, before.pp, p)
        slo, shi = max(lo, blo), min(hi, bhi)
        if slo >= shi:
            continue
        counts = slot_counts(model, slo, shi)
        kinds = _kinds(counts)
        skip: frozenset[int] = frozenset()
        if here is not None and here[0] == p and before.offload == after.offload:
            skip = kept_specs(model, before.tp, here[1], after.tp, u, before.ep, after.ep)
            pieces = tuple(Piece(i, b) for i in sorted(skip) if specs[i].kind in kinds
                           for b in rank_boxes(specs[i].spec, after.tp, after.ep, u))
            if pieces:
                volumes = [0, 0, 0]
                for piece in pieces:
                    volumes[_KINDS.index(specs[piece.spec].kind)] += box_volume(piece.box)
                volumes = tuple(volumes)
                out.append((KEEP, p, (slo, shi), pieces, _bytes(volumes, counts, element_bytes), (), volumes))
        for holders, pieces, volumes in source_groups(model, before.tp, after.tp, u, kinds, skip, before.ep,
                                                      after.ep):
            out.append(("pull", p, (slo, shi), pieces, _bytes(volumes, counts, element_bytes), holders, volumes))
    return tuple(out)


def _build_stage(module: Module, index: int, info: StageInfo, allocs: list, frees: list, xfers: list) -> None:
    model, before, after, eb = info.model, info.before, info.after, info.element_bytes
    node_of = module.cluster.node_of
    first = len(frees)
    free_index: dict[tuple[int, int, int], int] = {}
    position: dict[int, tuple[int, int, int]] = {}
    near: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    before_bytes = {(p, t): shard_bytes(model, before, p, t) for p in range(before.pp)
                    for t in range(before.stage_width)}
    for r in range(before.dp):
        for p in range(before.pp):
            for t in range(before.stage_width):
                g = before.gpu_of(r, p, t)
                free_index[(r, p, t)] = len(frees)
                frees.append(Free(index, r, (p, t), g, 0, before_bytes[(p, t)]))
                position[g] = (r, p, t)
                near.setdefault((node_of(g), p), []).append((r, t, g))
    kept_from = [0] * len(frees)
    rotation: dict[tuple, int] = {}
    recipes: dict[tuple, tuple] = {}

    def choose(g: int, p: int, holders: tuple[int, ...]) -> tuple[int, int, int]:
        here = position.get(g)
        if here is not None and here[1] == p and here[2] in holders:
            return here
        close = [c for c in near.get((node_of(g), p), ()) if c[1] in holders]
        key = (p, holders) if not close else (p, holders, node_of(g))
        turn = rotation.get(key, 0)
        rotation[key] = turn + 1
        if close:
            r, t, _ = close[turn % len(close)]
            return r, p, t
        return turn // len(holders) % before.dp, p, holders[turn % len(holders)]

    after_bytes = {(q, u): shard_bytes(model, after, q, u) for q in range(after.pp)
                   for u in range(after.stage_width)}
    for r in range(after.dp):
        for q in range(after.pp):
            for u in range(after.stage_width):
                g = after.gpu_of(r, q, u)
                alloc = len(allocs)
                here = position.get(g)
                key = (q, u, here[1:] if here else None)
                recipe = recipes.get(key)
                if recipe is None:
                    recipe = recipes[key] = _stage_recipe(model, before, after, q, u, key[2], eb)
                kept = 0
                for kind, p, slots, pieces, nbytes, holders, volumes in recipe:
                    if kind == KEEP:
                        src = free_index[here]
                        kept += nbytes
                        kept_from[src] += nbytes
                        xfers.append(Xfer(KEEP, index, alloc, src, g, g, slots, pieces, nbytes, volumes))
                        continue
                    src = free_index[choose(g, p, holders)]
                    src_gpu = frees[src].gpu
                    xfers.append(Xfer(COPY if src_gpu == g else SEND, index, alloc, src, src_gpu, g, slots,
                                      pieces, nbytes, volumes))
                full = after_bytes[(q, u)]
                allocs.append(Alloc(index, r, (q, u), g, full - kept, full))
    for i in range(first, len(frees)):
        f = frees[i]
        frees[i] = Free(f.stage, f.replica, f.pos, f.gpu, f.shard_bytes - kept_from[i], f.shard_bytes)


def dag_graph(dag: TransitionDag, schedule=None):
    """A networkx view (for graph algorithms only; the records above are the IR): nodes
    ("alloc", i), ("xfer", i), ("free", i); edges alloc → xfer → free, plus the resource
    edges free → alloc of `schedule` when given (attribute kind)."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(("alloc", i) for i in range(len(dag.allocs)))
    graph.add_nodes_from(("free", i) for i in range(len(dag.frees)))
    for i, x in enumerate(dag.xfers):
        graph.add_edge(("alloc", x.alloc), ("xfer", i))
        graph.add_edge(("xfer", i), ("free", x.free))
    for e in getattr(schedule, "edges", ()):
        graph.add_edge(("free", e.free), ("alloc", e.alloc), kind=e.kind)
    return graph
