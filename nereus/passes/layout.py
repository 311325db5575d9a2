"""layout: (model, placement) → which box of each global tensor every GPU of every unit holds.

Input: a `Model` and a `Placement` (dp × pp × ep × tp on an ordered GPU list). Output:
for an Elastic Model Unit (replica r) and a mesh position (pp stage p, stage rank
u = e·tp + t, where e is the EP rank and t the TP rank) on
gpu(r, p, u) = gpus[r·pp·ep·tp + p·ep·tp + u], the list of boxes of each tensor it holds.
With ep 1 the stage rank is the TP rank.

Invariant (tested): per replica, the union over (p, u) of the boxes of a tensor is the
whole tensor, and two boxes are either identical (replication: replicated tensors, KV heads
when tp > kv_heads, non-expert tensors on the ep ranks) or disjoint. An expert's tensors
(`TensorSpec.expert`) are held only by the EP rank that owns the expert
(e = expert // (experts / ep)), split there by TP like any column/row tensor; every other
tensor is held alike by all EP ranks (`rank_boxes`).

Layouts are symbolic. A model's tensors live in *slots*: slot 0 holds the tensors before
the first layer (embed), slot 1 + i holds layer i, slot layers + 1 holds final norm and
head. A pipeline stage holds a contiguous slot range; every layer slot has the same
tensor pattern, so the boxes of a tensor depend only on (spec, tp, t) and are computed once
(`tp_boxes`, cached). Per-layer names are produced only when a program is emitted.

Local shard contract (the runtime relies on it, docs/program.md): the local tensor of a
(unit, GPU, tensor) is the concatenation along dim 0 of its boxes in the listed order;
boxes of one shard differ only in dim 0.

ZeRO (`zero 1` on a training placement): the fp32 master weights and Adam state are
sharded over the dp replicas as FSDP2 shards a parameter: the GPU's TP shard of a tensor
(its local tensor) is cut along dim 0 into dp chunks of ceil(rows / dp) rows
(`torch.chunk`), replica d holding chunk d (`zero_boxes`; a chunk may be empty, then the
GPU holds no shard of that state). The bf16 weights stay whole on every replica, unless
`zero 3`, which chunks them the same way. So a unit no longer tiles the sharded tensors
alone: the dp units of the model-stage do, together. Per-parameter dim-0 chunks of TP
boxes are boxes again, so diff, DAG, lowering and the verifier need no new concept;
Megatron's alternative (contiguous ranges of one flattened, padded buffer per bucket)
cuts rows and would need segments over flat views:
it can be added as another partition function beside `zero_boxes`.
Zero needs ep 1 (validation refuses it with expert parallelism), so under zero the stage
rank is the TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

from nereus.models import (
    COLUMN,
    OPTIMIZER_DTYPE,
    OPTIMIZER_STATES,
    REPLICATED,
    ROW,
    VOCAB,
    TensorSpec,
    edge_tensors,
    layer_tensors,
    pp_layer_range,
)
from nereus.ir.model import DTYPE_BYTES, Model, Placement
from nereus.models.table import placement_boxes, table_specs

Box = tuple[tuple[int, int], ...]

# Suffixes of the tensors a unit holds per weight: training units also hold Adam state.
WEIGHTS_ONLY: tuple[str, ...] = ("",)
OPTIMIZER_SUFFIXES: tuple[str, ...] = tuple(f"#{s}" for s in OPTIMIZER_STATES)
WITH_OPTIMIZER: tuple[str, ...] = ("",) + OPTIMIZER_SUFFIXES


def unit_id(model_stage: str, replica: int) -> str:
    return f"{model_stage}/{replica}"


def states_of(model_stage: str) -> tuple[str, ...]:
    """Tensor-name suffixes held by units of `model_stage` of an architecture model:
    training units carry optimizer state. `unit_states` covers `tensors` models too."""
    return WITH_OPTIMIZER if model_stage.endswith(".training") else WEIGHTS_ONLY


def unit_states(model: Model, model_stage: str) -> tuple[str, ...]:
    """Tensor-name suffixes held by units of `model_stage`: an architecture model's
    training units carry fp32 master and Adam state (`states_of`), a `tensors` model's the
    states it declares (`states: exp_avg, exp_avg_sq`), in its dtype."""
    if model.is_table:
        return WEIGHTS_ONLY + (tuple(f"#{s}" for s in model.states) if model_stage.endswith(".training") else ())
    return states_of(model_stage)


def suffix_dtype(model: Model, suffix: str) -> str:
    return model.dtype if suffix == "" or model.is_table else OPTIMIZER_DTYPE


def bytes_per_element(model: Model, states: tuple[str, ...]) -> int:
    """Bytes one element of a weight costs on a GPU with all its `states` (2 or 2+12 for bf16)."""
    if model.is_table:  # every state in the table's own dtype
        return model.dtype_bytes * len(states)
    return _bytes_per_element(model.dtype, states)


@lru_cache(maxsize=None)
def _bytes_per_element(dtype: str, states: tuple[str, ...]) -> int:
    # keyed by the dtype, not the model: every transfer asks (45,896 times at 4,096 GPUs),
    # and hashing a frozen Model dataclass costs more than the sum
    return sum(DTYPE_BYTES[dtype if s == "" else OPTIMIZER_DTYPE] for s in states)


@dataclass(frozen=True)
class SlotSpec:
    """A tensor pattern and the slot kind it lives in: 'first' (slot 0), 'layer', 'last'."""

    spec: TensorSpec
    kind: str

    def name(self, model: str, slot: int) -> str:
        local = self.spec.name.format(i=slot - 1) if self.kind == "layer" else self.spec.name
        return f"{model}/{local}"


@lru_cache(maxsize=256)
def slot_specs(model: Model) -> tuple[SlotSpec, ...]:
    """Every tensor pattern of `model` in slot order: first, layer pattern, last."""
    first, last = edge_tensors(model)
    return (tuple(SlotSpec(s, "first") for s in first) + tuple(SlotSpec(s, "layer") for s in layer_tensors(model))
            + tuple(SlotSpec(s, "last") for s in last))


def slot_kind(model: Model, slot: int) -> str:
    return "first" if slot == 0 else ("last" if slot == model.layers + 1 else "layer")


def stage_slots(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Half-open slot range of pipeline stage `stage` (embed slot with the first stage,
    final norm and head slot with the last)."""
    lo, hi = pp_layer_range(layers, pp, stage)
    return lo + 1 - (stage == 0), hi + 1 + (stage == pp - 1)


def slot_counts(model: Model, lo: int, hi: int) -> dict[str, int]:
    """How many slots of each kind the half-open slot range [lo, hi) contains."""
    last = model.layers + 1
    return {
        "first": 1 if lo <= 0 < hi else 0,
        "layer": max(0, min(hi, last) - max(lo, 1)),
        "last": 1 if lo <= last < hi else 0,
    }


def _full(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> Box:
    return tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(shape))


# (a 256-expert model has ~1,500 tensor specs per layer: every (spec, tp, rank) of a
# 256-GPU change must stay cached through one compile, or each is computed again)
@lru_cache(maxsize=1 << 16)
def tp_boxes(spec: TensorSpec, tp: int, rank: int) -> tuple[Box, ...]:
    """Boxes of `spec` held by TP rank `rank` of `tp` (pure, cached; all layers share it).

    column: each fused part's rows split into tp equal parts, one box per part; a KV part
    with fewer heads than tp gives head rank // (tp / heads), i.e. each KV head replicated on
    tp/kv_heads consecutive ranks. row: dim 1 split. vocab: dim 0 split. replicated: whole."""
    shape = spec.shape
    if spec.sharding == REPLICATED or tp == 1 and spec.sharding != COLUMN:
        return (_full(shape, -1, 0, 0),)
    if spec.sharding == ROW:
        step = shape[1] // tp
        return (_full(shape, 1, rank * step, (rank + 1) * step),)
    if spec.sharding == VOCAB:
        step = shape[0] // tp
        return (_full(shape, 0, rank * step, (rank + 1) * step),)
    boxes = []
    offset = 0
    for part in spec.parts:
        # k and v are split by heads (replicated when tp > kv_heads); other parts (q, gate,
        # up) split their rows evenly, which equals a split by heads for q.
        if part.name in ("k", "v") and part.groups < tp:
            per_head = part.rows // part.groups
            head = rank // (tp // part.groups)
            lo = offset + head * per_head
            boxes.append(_full(shape, 0, lo, lo + per_head))
        else:
            step = part.rows // tp
            boxes.append(_full(shape, 0, offset + rank * step, offset + (rank + 1) * step))
        offset += part.rows
    return tuple(boxes)


def box_volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


@lru_cache(maxsize=1 << 16)
def rank_boxes(spec: TensorSpec, tp: int, ep: int, rank: int) -> tuple[Box, ...]:
    """Boxes of `spec` held by stage rank `rank` (= ep rank · tp + tp rank) of an ep × tp
    stage: an expert's tensor only on its owning EP rank (none elsewhere), everything else
    on every EP rank; inside, TP's boxes (`tp_boxes`). Pure, cached."""
    owner = spec.ep_owner(ep)
    if owner is not None and rank // tp != owner:
        return ()
    return tp_boxes(spec, tp, rank % tp)


@lru_cache(maxsize=8192)
def tp_volume(spec: TensorSpec, tp: int, rank: int, ep: int = 1) -> int:
    return sum(box_volume(b) for b in rank_boxes(spec, tp, ep, rank))


@lru_cache(maxsize=8192)
def kind_volume(model: Model, tp: int, rank: int, ep: int = 1) -> dict[str, int]:
    """Elements held per slot of each kind by stage rank `rank` (one layer, the embed slot, the last slot)."""
    out = {"first": 0, "layer": 0, "last": 0}
    for slot_spec in slot_specs(model):
        out[slot_spec.kind] += tp_volume(slot_spec.spec, tp, rank, ep)
    return out


def is_sharded(placement: Placement, states: tuple[str, ...]) -> bool:
    """Whether `states` (one group of a unit's tensor suffixes) are split over the dp
    replicas in `placement`: the optimizer group under zero >= 1, everything under 3."""
    return placement.zero >= 3 or placement.zero >= 1 and states[0] in OPTIMIZER_SUFFIXES


def chunk_rows(rows: int, dp: int, replica: int) -> tuple[int, int]:
    """Rows [lo, hi) of a local tensor with `rows` rows that replica `replica` of `dp`
    holds of zero-sharded state: dp chunks of ceil(rows / dp) rows (torch.chunk; the last
    chunks may be short or empty, then lo == hi)."""
    size = -(-rows // dp)
    lo = min(replica * size, rows)
    return lo, min(lo + size, rows)


def chunk_boxes(boxes, lo: int, hi: int) -> tuple[Box, ...]:
    """The global boxes that local rows [lo, hi) of a shard made of `boxes` (stacked along
    dim 0) cover, in local order."""
    out, offset = [], 0
    for b in boxes:
        n = b[0][1] - b[0][0]
        a, z = max(lo, offset), min(hi, offset + n)
        if a < z:
            out.append(((b[0][0] + a - offset, b[0][0] + z - offset), *b[1:]))
        offset += n
    return tuple(out)


@lru_cache(maxsize=None)
def zero_boxes(spec: TensorSpec, tp: int, rank: int, dp: int, replica: int) -> tuple[Box, ...]:
    """Replica `replica`'s chunk of TP rank `rank`'s local tensor of `spec`: the
    concatenation of `tp_boxes` along dim 0 cut by `chunk_rows`, as boxes of the global
    tensor in local order. Pure, cached; the same for every layer."""
    boxes = tp_boxes(spec, tp, rank)
    return chunk_boxes(boxes, *chunk_rows(sum(b[0][1] - b[0][0] for b in boxes), dp, replica))


def held_boxes(spec: TensorSpec, placement: Placement, replica: int, rank: int, states: tuple[str, ...]):
    """Boxes of `spec`'s tensors with suffixes `states` on stage rank `rank` of `replica`.
    Sharded states have ep 1 (validation refuses zero with ep > 1), so there the stage rank
    is the TP rank. A mesh layout gives every state the tensor's boxes."""
    if placement.layout is not None:
        return placement_boxes(spec, placement, rank)
    if is_sharded(placement, states):
        return zero_boxes(spec, placement.tp, rank, placement.dp, replica)
    return rank_boxes(spec, placement.tp, placement.ep, rank)


@lru_cache(maxsize=None)
def zero_kind_volume(model: Model, tp: int, rank: int, dp: int, replica: int) -> dict[str, int]:
    """`kind_volume` of the chunk replica `replica` holds of each sharded state."""
    out = {"first": 0, "layer": 0, "last": 0}
    for slot_spec in slot_specs(model):
        out[slot_spec.kind] += sum(box_volume(b) for b in zero_boxes(slot_spec.spec, tp, rank, dp, replica))
    return out


def zero_shard_elements(model: Model, tp: int, pp: int, stage: int, rank: int, dp: int, replica: int) -> int:
    """Elements of one sharded state (master, exp_avg or exp_avg_sq) on the GPU of
    (replica, stage, rank) under zero >= 1."""
    counts = slot_counts(model, *stage_slots(model.layers, pp, stage))
    volume = zero_kind_volume(model, tp, rank, dp, replica)
    return sum(counts[k] * volume[k] for k in counts)


def shard_elements(model: Model, tp: int, pp: int, stage: int, rank: int, ep: int = 1) -> int:
    """Elements of every weight a GPU at (stage, stage rank) holds (per state)."""
    counts = slot_counts(model, *stage_slots(model.layers, pp, stage))
    volume = kind_volume(model, tp, rank, ep)
    return sum(counts[k] * volume[k] for k in counts)


def shard_bytes(model: Model, placement: Placement, stage: int, rank: int, replica: int = 0) -> int:
    """Bytes of the state one GPU of a unit of `placement` holds (weights, plus fp32 Adam
    state for training units, a dp-th of it under zero 1, of everything under zero 3;
    gradients are not part of the
    moved state). `replica` matters only under zero (chunks may differ by one row)."""
    states = unit_states(model, str(placement.model_stage))
    if placement.layout is not None:
        return mesh_shard_elements(model, placement, rank) * bytes_per_element(model, states)
    elements = shard_elements(model, placement.tp, placement.pp, stage, rank, placement.ep)
    if placement.zero >= 1 and len(states) > 1:
        sharded = zero_shard_elements(model, placement.tp, placement.pp, stage, rank, placement.dp, replica)
        weights = sharded if placement.zero >= 3 else elements
        return weights * bytes_per_element(model, states[:1]) + sharded * bytes_per_element(model, states[1:])
    return elements * bytes_per_element(model, states)


def shard_bytes_table(model: Model, placement: Placement) -> dict[tuple[int, int, int], int]:
    """{(replica, stage, rank): shard_bytes(model, placement, stage, rank, replica)} for
    every GPU of `placement`, with the per-(stage, rank) and per-(rank, replica) parts
    computed once each instead of once per GPU (4,096 GPUs: 512 chunk volumes, not 4,096)."""
    states = unit_states(model, str(placement.model_stage))
    if placement.layout is not None:
        per = bytes_per_element(model, states)
        return {(0, 0, u): mesh_shard_elements(model, placement, u) * per for u in range(len(placement.gpus))}
    tp, pp, dp, width = placement.tp, placement.pp, placement.dp, placement.stage_width
    elements = {(p, t): shard_elements(model, tp, pp, p, t, placement.ep) for p in range(pp) for t in range(width)}
    if not (placement.zero >= 1 and len(states) > 1):
        per = bytes_per_element(model, states)
        return {(r, p, t): elements[(p, t)] * per for r in range(dp) for p in range(pp) for t in range(width)}
    weight_bytes, state_bytes = bytes_per_element(model, states[:1]), bytes_per_element(model, states[1:])
    counts = [slot_counts(model, *stage_slots(model.layers, pp, p)) for p in range(pp)]
    out = {}
    for t in range(width):
        for r in range(dp):
            volume = zero_kind_volume(model, tp, t, dp, r)
            for p in range(pp):
                sharded = sum(n * volume[k] for k, n in counts[p].items())
                weights = sharded if placement.zero >= 3 else elements[(p, t)]
                out[(r, p, t)] = weights * weight_bytes + sharded * state_bytes
    return out


def mesh_shard_elements(model: Model, placement: Placement, rank: int) -> int:
    """Elements of every table tensor the GPU at index `rank` of a mesh layout holds (one state)."""
    return sum(box_volume(b) for spec in table_specs(model) for b in placement_boxes(spec, placement, rank))


def mesh_positions(placement: Placement) -> Iterator[tuple[int, int, int, int]]:
    """(replica, pp stage, stage rank, gpu) for every GPU of the placement, in mesh order."""
    i = 0
    for r in range(placement.dp):
        for p in range(placement.pp):
            for t in range(placement.stage_width):
                yield r, p, t, placement.gpus[i]
                i += 1


def gpu_shards(model: Model, placement: Placement, stage: int, rank: int,
               replica: int = 0) -> Iterator[tuple[str, tuple[Box, ...]]]:
    """(global tensor name, boxes) of everything the GPU at (replica, stage, rank) holds,
    in slot order, optimizer state after each weight (under zero, only the non-empty
    chunks of it). Expands layers: use for emission only."""
    lo, hi = stage_slots(model.layers, placement.pp, stage)
    states = unit_states(model, str(placement.model_stage))
    if placement.layout is not None:
        for spec in table_specs(model):
            boxes = placement_boxes(spec, placement, rank)
            if boxes:
                name = f"{model.name}/{spec.name}"
                for suffix in states:
                    yield name + suffix, boxes
        return
    sharded = placement.zero >= 1 and len(states) > 1
    specs = slot_specs(model)
    for slot in range(lo, hi):
        kind = slot_kind(model, slot)
        for slot_spec in specs:
            if slot_spec.kind != kind:
                continue
            boxes = rank_boxes(slot_spec.spec, placement.tp, placement.ep, rank)
            if not boxes:  # another EP rank's expert
                continue
            chunk = zero_boxes(slot_spec.spec, placement.tp, rank, placement.dp, replica) if sharded else boxes
            name = slot_spec.name(model.name, slot)
            for suffix in states:
                mine = boxes if suffix == "" and placement.zero < 3 else chunk
                if mine:
                    yield name + suffix, mine


def tensor_entries(model: Model, states: tuple[str, ...]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(global name, shape, dtype) of every tensor a unit with `states` covers, slot order."""
    specs = slot_specs(model)
    for slot in range(model.layers + 2):
        kind = slot_kind(model, slot)
        for slot_spec in specs:
            if slot_spec.kind == kind:
                name = slot_spec.name(model.name, slot)
                for suffix in states:
                    yield name + suffix, slot_spec.spec.shape, suffix_dtype(model, suffix)


# -- JSON program v2: tensor families (nereus.ir.ranges, docs/program.md) ------------------


@lru_cache(maxsize=None)
def spec_family(slot_spec: SlotSpec, model: str) -> tuple[str, Optional[int]]:
    """(family, expert) of a tensor pattern: a layer tensor's name with `{}` for its layer
    (and for its expert index, an expert's: `actor/layers.{}.mlp.experts.{}.down.weight`),
    the expert index or None; a tensor outside the layers is its own plain name."""
    spec = slot_spec.spec
    if slot_spec.kind != "layer":
        return slot_spec.name(model, 0), None
    local = spec.name.replace("{i}", "{}")
    if spec.expert is not None:
        marker = f".{spec.expert}."
        if local.count(marker) != 1:
            raise ValueError(f"cannot find expert {spec.expert} in tensor pattern {spec.name!r}")
        local = local.replace(marker, ".{}.")
    return f"{model}/{local}", spec.expert


def family_entries(model: Model, states: tuple[str, ...]) -> Iterator[tuple[str, tuple, tuple[int, ...], str]]:
    """(family, indices, shape, dtype) of every tensor a unit with `states` covers, as JSON
    program v2 declares them: plain names outside the layers ((), no indices), one family
    per layer pattern over [0, layers) (and [0, experts) for an expert's pattern)."""
    specs = slot_specs(model)
    seen = set()
    for kind in ("first", "layer", "last"):
        for slot_spec in specs:
            if slot_spec.kind != kind:
                continue
            fam, expert = spec_family(slot_spec, model.name)
            if fam in seen:
                continue
            seen.add(fam)
            if kind != "layer":
                indices: tuple = ()
            elif expert is None:
                indices = ((0, model.layers),)
            else:
                indices = ((0, model.layers), (0, slot_spec.spec.experts))
            for suffix in states:
                yield fam + suffix, indices, slot_spec.spec.shape, suffix_dtype(model, suffix)


def ranged_gpu_shards(model: Model, placement: Placement, stage: int, rank: int,
                      replica: int = 0) -> tuple[tuple[str, tuple, tuple[Box, ...]], ...]:
    """(family, at, boxes) of everything the GPU at (replica, stage, rank) holds, as JSON
    program v2 lists shards: `gpu_shards` with the layers of the stage as one range and the
    experts the GPU's EP rank owns as one run (`at` = () for a plain name). Work per tensor
    pattern, not per layer or expert; cached per layout position. A mesh layout's tensors
    are plain names."""
    if placement.layout is not None:
        return tuple((name, (), boxes) for name, boxes in gpu_shards(model, placement, stage, rank, replica))
    return _ranged_shards(model, placement.tp, placement.ep, placement.pp, placement.dp, placement.zero,
                          states_of(str(placement.model_stage)), stage, rank, replica)


@lru_cache(maxsize=1 << 14)
def _ranged_shards(model: Model, tp: int, ep: int, pp: int, dp: int, zero: int, states: tuple, stage: int,
                   rank: int, replica: int) -> tuple:
    lo, hi = stage_slots(model.layers, pp, stage)
    sharded = zero >= 1 and len(states) > 1
    layers = (max(lo, 1) - 1, min(hi, model.layers + 1) - 1)
    out = []
    for kind in ("first", "layer", "last"):
        if kind == "first" and lo > 0 or kind == "last" and hi <= model.layers + 1 or \
                kind == "layer" and layers[0] >= layers[1]:
            continue
        groups: dict = {}  # (family, boxes by state) -> `at` ranges, in first-pattern order
        for slot_spec in slot_specs(model):
            spec = slot_spec.spec
            if slot_spec.kind != kind or spec.expert not in (None, 0):
                continue  # an expert's pattern is handled at its expert 0: every expert has its shape
            if spec.expert is None:
                boxes = rank_boxes(spec, tp, ep, rank)
                at: tuple = ((layers[0], layers[1], 1),) if kind == "layer" else ()
            else:  # the experts this GPU's EP rank owns, one contiguous run, TP's boxes each
                per = spec.experts // ep
                owner = rank // tp
                boxes = tp_boxes(spec, tp, rank % tp)
                at = ((layers[0], layers[1], 1), (owner * per, (owner + 1) * per, 1))
            if not boxes:
                continue
            chunk = zero_boxes(spec, tp, rank, dp, replica) if sharded else boxes
            per_state = tuple(boxes if s == "" and zero < 3 else chunk for s in states)
            fam, _ = spec_family(slot_spec, model.name)
            groups.setdefault((fam, per_state), at)
        for (fam, per_state), at in groups.items():
            for suffix, mine in zip(states, per_state):
                if mine:
                    out.append((fam + suffix, at, mine))
    return tuple(out)
