"""A Nereus plan's placement of an architecture model as DTensor placements of its
Hugging Face parameters: how to parallelize a transformers module the way the plan (or
the controller's chosen plan) says.

    spec = placements_for("plan.nir", "S2", "actor.training")
    mesh = spec.device_mesh("cuda")                 # init_device_mesh-like, ranks from the plan
    spec.placements["model.layers.0.self_attn.q_proj.weight"]   # (Replicate(), Shard(dim=0))
    spec.tp_plan["model.layers.0.self_attn.q_proj"]             # "colwise" (parallelize_module)

Input: a `.nir` file (or a parsed Module), a plan and a model-stage placed with dp, tp
(pp, zero). Output: `ParallelSpec`: a 2-D (dp, tp) mesh per pipeline stage over the
plan's GPUs (rank r = GPU r), and per HF parameter its stage and one placement per mesh
dimension: tp splits column tensors (q/k/v, gate/up, their biases) on dim 0, row tensors
(o, down) on dim 1, the vocabulary (embedding, head) on dim 0; norms are replicated;
`zero 3` adds FSDP2's split of each rank's TP shard over dp (`_StridedShard(0, sf=tp)`
over a dim-0 TP split, `Shard(0)` otherwise; per HF parameter, where Nereus chunks its
fused q|k|v as one tensor). Invariant (checked, per parameter and rank): the placements
give every rank exactly the rows and columns of the HF tensor that the plan's layout
gives it of the fused Nereus tensor. What DTensor cannot express is an InteropError
naming the parameter: KV heads replicated over TP ranks (tp > kv_heads), expert
parallelism, and `zero 1` (an optimizer split, not a parameter placement: its parameters
are replicated over dp; `spec.zero` says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from nereus.ir.mesh import shard_boxes
from nereus.ir.model import DimPlacement, Module

from .errors import InteropError


@dataclass(frozen=True)
class ParallelSpec:
    plan: str
    model_stage: str
    mesh_dim_names: tuple[str, ...]  # ("dp", "tp")
    mesh_shape: tuple[int, ...]  # (dp, tp)
    stage_ranks: tuple[tuple[tuple[int, ...], ...], ...]  # per pipeline stage: the (dp, tp) grid of ranks
    stage_of: dict = field(default_factory=dict)  # HF name -> pipeline stage
    layouts: dict = field(default_factory=dict)  # HF name -> (DimPlacement for dp, for tp)
    tp_plan: dict = field(default_factory=dict)  # module name -> "colwise" | "rowwise" (parallelize_module)
    zero: int = 0

    @property
    def placements(self) -> dict:
        """HF name -> torch.distributed.tensor placements, one per mesh dimension."""
        return {name: tuple(_torch_placement(p) for p in layout) for name, layout in self.layouts.items()}

    def device_mesh(self, device_type: str = "cuda", stage: int = 0):
        """The DeviceMesh of pipeline stage `stage` (collective, as DeviceMesh is)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(self.stage_ranks[stage]), mesh_dim_names=self.mesh_dim_names)


def _torch_placement(p: DimPlacement):
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if p.kind == "replicate":
        return Replicate()
    if p.kind == "shard":
        return Shard(p.dim)
    return _StridedShard(p.dim, split_factor=p.split)


def placements_for(plan_file: Union[str, Module], plan: str, model_stage: str) -> ParallelSpec:
    """See the module docstring."""
    from nereus.ir import parse_file
    from nereus.models import COLUMN, REPLICATED, ROW, VOCAB
    from nereus.models.hf import hf_targets
    from nereus.passes.layout import rank_boxes

    module = parse_file(plan_file) if isinstance(plan_file, str) else plan_file
    try:
        placement = module.plan(plan).placement(model_stage)
    except KeyError:
        raise InteropError(f"plan {plan} has no placement of {model_stage}",
                           hint=f"plans: {', '.join(p.name for p in module.plans)}") from None
    model = module.model(placement.model_stage.model)
    if model.is_table:
        raise InteropError(f"{model.name} is a tensors model: its plan's mesh layout is already per parameter")
    if placement.ep > 1:
        raise InteropError(f"{model_stage} uses expert parallelism (ep {placement.ep}): each expert lives whole on "
                           "one rank, which is not a DTensor placement of it", hint="use a plan with ep 1")
    dp, tp, pp = placement.dp, placement.tp, placement.pp
    zero = placement.zero if placement.model_stage.stage == "training" else 0
    specs = {spec.name: spec for spec in _table(model)}
    stage_ranks = tuple(tuple(tuple(placement.gpu_of(r, p, t) for t in range(tp)) for r in range(dp))
                        for p in range(pp))
    stage_of, layouts, tp_plan = {}, {}, {}
    for hf, target in hf_targets(model).items():
        local = target.tensor.split("/", 1)[1]
        spec = specs[local]
        kind = {COLUMN: "colwise", VOCAB: "colwise", ROW: "rowwise", REPLICATED: None}[spec.sharding]
        tp_dim = {COLUMN: 0, VOCAB: 0, ROW: 1}.get(spec.sharding)
        tp_place = DimPlacement("replicate") if tp_dim is None or tp == 1 else DimPlacement("shard", tp_dim)
        if zero >= 3:
            dp_place = DimPlacement("strided", 0, tp) if tp_dim == 0 and tp > 1 else DimPlacement("shard", 0)
        else:
            dp_place = DimPlacement("replicate")
        layout = (dp_place, tp_place)
        stage = _stage_of(spec, model, pp)
        _check(hf, target, spec, layout, tp, rank_boxes)
        stage_of[hf] = stage
        layouts[hf] = layout
        if kind is not None and tp > 1 and hf.endswith(".weight") and spec.layer is not None:
            tp_plan[hf[: -len(".weight")]] = kind
    return ParallelSpec(plan, model_stage, ("dp", "tp"), (dp, tp), stage_ranks, stage_of, layouts, tp_plan, zero)


def _table(model):
    from nereus.models import tensor_table

    return tensor_table(model)


def _stage_of(spec, model, pp: int) -> int:
    from nereus.models import pp_layer_range

    if spec.layer is None:
        return 0 if spec.role == "embed" else pp - 1
    return next(p for p in range(pp) if pp_layer_range(model.layers, pp, p)[0] <= spec.layer
                < pp_layer_range(model.layers, pp, p)[1])


def _check(hf: str, target, spec, layout, tp: int, rank_boxes) -> None:
    """The HF parameter's boxes under `layout` equal the rows of the fused Nereus tensor
    the plan gives each (dp, tp) rank, shifted to the parameter (per-parameter FSDP
    chunks under zero 3: only the TP split is compared there)."""
    lo, hi = target.rows
    for t in range(tp):
        plan_rows = []
        for box in rank_boxes(spec, tp, 1, t):
            a, b = max(box[0][0], lo), min(box[0][1], hi)
            if a < b:
                plan_rows.append(((a - lo, b - lo),) + tuple(box[1:]))
        mine = shard_boxes(target.shape, (tp,), (t,), (layout[1],))
        if tuple(plan_rows) != tuple(mine):
            raise InteropError(f"{hf}: the plan gives TP rank {t} {_rows(plan_rows)}, which no DTensor placement of "
                               "the parameter gives", name=hf,
                               hint="a KV head replicated over TP ranks (tp > kv_heads) is not a DTensor split; "
                                    "use a tp that divides kv_heads")


def _rows(boxes) -> str:
    return ", ".join(f"rows {b[0][0]}..{b[0][1]}" for b in boxes) or "nothing"
