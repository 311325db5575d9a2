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

ZeRO: when either side of a training model-stage has `zero 1` or 3, its states form two
groups (`StageInfo.groups`): the weights and the optimizer states. A group replicated on
both sides moves as above; a group sharded on either side (optimizer states under zero 1,
both under zero 3: boxes that depend on the replica, `layout.zero_boxes`) has the pieces
an after GPU needs cut by the (replica, TP rank) pairs that hold them (`sharded_pieces`),
so each chunk comes from the one replica that owns it: a DP change re-partitions sharded
state instead of copying it into every new replica.
An `Xfer` names the states it carries (`states`).
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
    is_sharded,
    shard_bytes_table,
    slot_counts,
    slot_specs,
    stage_slots,
    unit_states,
    rank_boxes,
    tp_boxes,
    box_volume,
)
from .dag_mesh import build_mesh_stage
from .dag_records import Alloc, Free, Piece, Xfer  # noqa: F401  (the records, re-exported)
from .sharded import mesh_key, group_boxes, sharded_pieces

KEEP, COPY, SEND = "keep", "copy", "send"
_KINDS = ("first", "layer", "last")


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

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """State groups moved separately: all states together, or under ZeRO on either side
        the weights and the optimizer states (each replica-dependent where sharded)."""
        if (self.before.zero or self.after.zero) and len(self.states) > 1:
            return (self.states[:1], self.states[1:])
        return (self.states,)

    def xfer_element_bytes(self, states: tuple[str, ...]) -> int:
        """Bytes per element of a transfer carrying `states`."""
        return self.element_bytes if states == self.states else bytes_per_element(self.model, states)


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


@lru_cache(maxsize=1 << 16)  # (per spec and rank pair: a 256-expert change asks ~3 x 10^4)
def tp_pieces(spec, tp_before: int, tp_after: int, rank_after: int, ep_before: int = 1,
              ep_after: int = 1) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """The after stage rank's boxes of `spec` cut into maximal pieces each held by one set
    of before stage ranks: ((piece box, holder ranks), ...). Pure, cached per mesh pair.
    An expert's tensor has holders only on its owning EP rank."""
    dim = split_dim(spec.sharding)
    # rank_boxes of every before stage rank, asked per TP rank once (an expert's tensor: on
    # its owner's ranks only; 256-GPU MoE changes ask this ~10^4 times a compile)
    owner = spec.ep_owner(ep_before)
    ranks = range(owner * tp_before, (owner + 1) * tp_before) if owner is not None else range(tp_before * ep_before)
    boxes = [tp_boxes(spec, tp_before, r) for r in range(tp_before)]
    every = tuple(t for t in ranks if boxes[t % tp_before])
    wanted = rank_boxes(spec, tp_after, ep_after, rank_after)
    if dim is None:
        return tuple((box, every) for box in wanted)
    held = [(t, b[dim]) for t in every for b in boxes[t % tp_before]]
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
        states = unit_states(model, sd.model_stage)
        stages.append(StageInfo(sd.model_stage, model, sd.before, sd.after, states,
                                bytes_per_element(model, states), sd))
    allocs: list[Alloc] = []
    frees: list[Free] = []
    xfers: list[Xfer] = []
    for index, info in enumerate(stages):
        if info.before.layout is not None or info.after.layout is not None:
            build_mesh_stage(module, index, info, allocs, frees, xfers)
        else:
            _build_stage(module, index, info, allocs, frees, xfers)
    return TransitionDag(module, diff.source, diff.target, tuple(stages), tuple(untouched), tuple(resident),
                         tuple(allocs), tuple(frees), tuple(xfers))


def _stage_recipe(model: Model, before: Placement, after: Placement, q: int, u: int,
                  here: Optional[tuple[int, int]], element_bytes: int, states: tuple[str, ...]) -> tuple[tuple, ...]:
    """What the after GPU at (pp stage q, stage rank u) needs of the replicated `states`, per
    before pipeline stage: ("keep", p, slots, pieces, bytes, (), volumes, states) for shards
    identical on its own GPU (`here` is the (pp stage, stage rank) that GPU had before, or
    None) and ("pull", p, slots, pieces, bytes, holders, volumes, states) for each group of
    pieces held by the same before TP ranks. The same for every replica: computed once per
    (q, u, here)."""
    specs = slot_specs(model)
    out = []
    for p, slots, counts, kinds in _overlaps(model, before, after, q):
        skip: frozenset[int] = frozenset()
        if here is not None and here[0] == p and before.offload == after.offload:
            skip = kept_specs(model, before.tp, here[1], after.tp, u, before.ep, after.ep)
            pieces = tuple(Piece(i, b) for i in sorted(skip) if specs[i].kind in kinds
                           for b in rank_boxes(specs[i].spec, after.tp, after.ep, u))
            if pieces:
                volumes = _volumes(specs, pieces)
                out.append((KEEP, p, slots, pieces, _bytes(volumes, counts, element_bytes), (), volumes, states))
        for holders, pieces, volumes in source_groups(model, before.tp, after.tp, u, kinds, skip, before.ep,
                                                      after.ep):
            out.append(("pull", p, slots, pieces, _bytes(volumes, counts, element_bytes), holders, volumes, states))
    return tuple(out)


def _sharded_recipe(model: Model, before: Placement, after: Placement, r: int, q: int, u: int,
                    here: Optional[tuple[int, int, int]], element_bytes: int,
                    states: tuple[str, ...], memo: dict) -> tuple[tuple, ...]:
    """`_stage_recipe` for the optimizer states under ZeRO: the after GPU is (replica r,
    q, u), `here` the (replica, pp stage, tp rank) its GPU had before (or None); holders of
    a pull are (replica, tp rank) pairs when the before side shards the state. `memo`
    caches boxes and pieces by spec index for one model-stage (this runs once per GPU:
    small-int keys hash much faster than tensor specs)."""
    specs = slot_specs(model)
    bkey, akey = mesh_key(before, states), mesh_key(after, states)

    def boxes(i: int, side: tuple, replica: int, rank: int):
        key = (i, side, replica, rank)
        found = memo.get(key)
        if found is None:
            found = memo[key] = group_boxes(specs[i].spec, side, replica, rank)
        return found

    def pieces_of(i: int):
        """((Piece, holders, volume), ...): built once per (spec, replica, rank) and reused
        by every pp stage pair of that GPU position (frozen Pieces are costly to build)."""
        key = ("pieces", i, bkey, akey, r, u)
        found = memo.get(key)
        if found is None:
            found = memo[key] = tuple((Piece(i, box), holders, box_volume(box))
                                      for box, holders in sharded_pieces(specs[i].spec, bkey, akey, r, u))
        return found

    def pulls(kinds: tuple[str, ...], skip: frozenset[int]) -> tuple:
        """((holders, pieces, volumes), ...) of the specs of `kinds` not in `skip`, holders
        sorted: the same for every pp stage pair of this GPU position with those kinds."""
        key = ("pulls", bkey, akey, r, u, kinds, skip)
        found = memo.get(key)
        if found is None:
            groups: dict[tuple, list] = {}
            for i, slot_spec in enumerate(specs):
                if i in skip or slot_spec.kind not in kinds:
                    continue
                kind = _KINDS.index(slot_spec.kind)
                for piece, holders, volume in pieces_of(i):
                    entry = groups.setdefault(holders, [[], [0, 0, 0]])
                    entry[0].append(piece)
                    entry[1][kind] += volume
            found = memo[key] = tuple((h, tuple(p), tuple(v)) for h, (p, v) in sorted(groups.items()))
        return found

    out = []
    for p, slots, counts, kinds in _overlaps(model, before, after, q):
        skip: frozenset[int] = frozenset()
        if here is not None and here[1] == p and before.offload == after.offload:
            present = [i for i, slot_spec in enumerate(specs) if slot_spec.kind in kinds]
            skip = frozenset(i for i in present if (mine := boxes(i, akey, r, u))
                             and mine == boxes(i, bkey, here[0], here[2]))
            pieces = tuple(Piece(i, b) for i in sorted(skip) for b in boxes(i, akey, r, u))
            if pieces:
                volumes = _volumes(specs, pieces)
                out.append((KEEP, p, slots, pieces, _bytes(volumes, counts, element_bytes), (), volumes, states))
        for holders, pieces, volumes in pulls(kinds, skip):
            out.append(("pull", p, slots, pieces, _bytes(volumes, counts, element_bytes), holders, volumes, states))
    return tuple(out)


def _overlaps(model: Model, before: Placement, after: Placement, q: int):
    """(before pp stage p, slot range, slot counts, slot kinds) of every before stage whose
    slots overlap after pp stage q's."""
    return _overlap_table(model, before.pp, after.pp, q)


@lru_cache(maxsize=4096)
def _overlap_table(model: Model, before_pp: int, after_pp: int, q: int) -> tuple:
    lo, hi = stage_slots(model.layers, after_pp, q)
    out = []
    for p in range(before_pp):
        blo, bhi = stage_slots(model.layers, before_pp, p)
        slo, shi = max(lo, blo), min(hi, bhi)
        if slo < shi:
            counts = slot_counts(model, slo, shi)
            out.append((p, (slo, shi), counts, _kinds(counts)))
    return tuple(out)


def _volumes(specs, pieces) -> tuple[int, int, int]:
    volumes = [0, 0, 0]
    for piece in pieces:
        volumes[_KINDS.index(specs[piece.spec].kind)] += box_volume(piece.box)
    return tuple(volumes)


def _build_stage(module: Module, index: int, info: StageInfo, allocs: list, frees: list, xfers: list) -> None:
    model, before, after = info.model, info.before, info.after
    groups = info.groups
    node_of = module.cluster.node_of
    first = len(frees)
    free_index: dict[tuple[int, int, int], int] = {}
    position: dict[int, tuple[int, int, int]] = {}
    near: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    before_bytes = shard_bytes_table(model, before)
    # a Free is built once, at the end, when the bytes kept in place are known; until
    # then its slot holds (r, p, t) and `free_gpu` its GPU
    free_gpu: list[int] = [0] * len(frees)
    before_gpus = iter(before.gpus)  # gpu_of(r, p, t) in this loop's order
    for r in range(before.dp):
        for p in range(before.pp):
            for t in range(before.stage_width):
                g = next(before_gpus)
                free_index[(r, p, t)] = len(frees)
                frees.append((r, p, t))
                free_gpu.append(g)
                position[g] = (r, p, t)
                near.setdefault((node_of(g), p), []).append((r, t, g))
    kept_from = [0] * len(frees)
    rotation: dict[tuple, int] = {}
    recipes: dict[tuple, tuple] = {}
    memo: dict = {}
    nearby: dict[tuple, tuple] = {}  # (node, before pp stage, holders) -> (candidates on that node, rotation key)
    per_node = module.cluster.gpus_per_node  # node_of(g) == g // per_node

    def choose(g: int, p: int, holders: tuple) -> tuple[int, int, int]:
        here = position.get(g)
        sharded = holders and isinstance(holders[0], tuple)  # (replica, tp rank) pairs: a sharded state
        if here is not None and here[1] == p and ((here[0], here[2]) if sharded else here[2]) in holders:
            return here
        node = g // per_node
        found = nearby.get((node, p, holders))
        if found is None:  # once per (node, p, holders): the candidates on the node and the rotation key
            if sharded:
                close = [c for c in near.get((node, p), ()) if (c[0], c[1]) in holders]
            else:
                close = [c for c in near.get((node, p), ()) if c[1] in holders]
            found = nearby[(node, p, holders)] = (close, (p, holders, node) if close else (p, holders))
        close, key = found
        turn = rotation.get(key, 0)
        rotation[key] = turn + 1
        if close:
            r, t, _ = close[turn % len(close)]
            return r, p, t
        if sharded:
            r, t = holders[turn % len(holders)]
            return r, p, t
        return turn // len(holders) % before.dp, p, holders[turn % len(holders)]

    sharding = {states: (is_sharded(before, states), is_sharded(after, states)) for states in groups}

    def group_recipe(r: int, q: int, u: int, here, states: tuple[str, ...]) -> tuple:
        """The recipe of one state group, shared by every GPU it can be shared by."""
        sharded_before, sharded_after = sharding[states]
        if not (sharded_before or sharded_after):
            key = (states, q, u, here[1:] if here else None)
            found = recipes.get(key)
            if found is None:
                found = recipes[key] = _stage_recipe(model, before, after, q, u, key[3],
                                                     info.xfer_element_bytes(states), states)
            return found
        # replica indices matter only on a side that shards the group
        ra = r if sharded_after else 0
        mine = (here[0] if sharded_before else 0, here[1], here[2]) if here else None
        key = (states, ra, q, u, mine)
        if key not in recipes:
            recipes[key] = _sharded_recipe(model, before, after, ra, q, u, mine, info.xfer_element_bytes(states),
                                           states, memo)
        return recipes[key]

    after_bytes = shard_bytes_table(model, after)
    after_gpus = iter(after.gpus)  # gpu_of(r, q, u) in this loop's order
    for r in range(after.dp):
        for q in range(after.pp):
            for u in range(after.stage_width):
                g = next(after_gpus)
                alloc = len(allocs)
                here = position.get(g)
                recipe = ()
                for states in groups:
                    recipe += group_recipe(r, q, u, here, states)
                kept = 0
                for kind, p, slots, pieces, nbytes, holders, volumes, states in recipe:
                    if kind == KEEP:
                        src = free_index[here]
                        kept += nbytes
                        kept_from[src] += nbytes
                        xfers.append(Xfer(KEEP, index, alloc, src, g, g, slots, pieces, nbytes, volumes, states))
                        continue
                    src = free_index[choose(g, p, holders)]
                    src_gpu = free_gpu[src]
                    xfers.append(Xfer(COPY if src_gpu == g else SEND, index, alloc, src, src_gpu, g, slots,
                                      pieces, nbytes, volumes, states))
                full = after_bytes[(r, q, u)]
                allocs.append(Alloc(index, r, (q, u), g, full - kept, full))
    for i in range(first, len(frees)):
        r, p, t = frees[i]
        full = before_bytes[(r, p, t)]
        frees[i] = Free(index, r, (p, t), free_gpu[i], full - kept_from[i], full)


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
