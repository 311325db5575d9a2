"""The rules of `tensors` models and mesh layouts (docs/ir.md, "Mesh layouts"), checked on
a Module by validate.py:

- a `tensors` model sets none of the architecture keys and is placed by a mesh layout
  only; a mesh layout places a `tensors` model only;
- the mesh's sizes multiply to the placement's GPU count; a rule's own mesh likewise, on
  GPUs of the placement;
- every rule has one placement per mesh dimension, each splitting a dimension the matched
  tensors have; every rule matches a tensor and every tensor matches a rule;
- no tensor is strided along a dimension other than 0 on any GPU (the programs stack a
  shard's boxes along dim 0).
"""

from __future__ import annotations

import fnmatch

from .diagnostics import SemanticError, did_you_mean
from .gpuset import set_location
from .model import DTYPE_BYTES, MeshLayout, Model, Module, Placement

ARCHITECTURE_KEYS: tuple[str, ...] = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts",
                                      "experts_per_token", "expert_ffn")


def validate_table_model(model: Model) -> None:
    """A `tensors` model: a known dtype, no architecture sizes (an alias may not add them)."""
    if model.dtype not in DTYPE_BYTES:
        raise SemanticError(f"unknown dtype '{model.dtype}'", model.loc, f"dtypes: {', '.join(DTYPE_BYTES)}")
    for key in ARCHITECTURE_KEYS:
        if getattr(model, key):
            from .model import key_loc

            raise SemanticError(f"'{key}' does not apply to {model.name}, a tensors model", key_loc(model, key),
                                "a tensors model is its tensor table: drop the key")
    for state in model.states:
        if not state.isidentifier():
            raise SemanticError(f"state name '{state}' is not a name", model.loc, "e.g. states: exp_avg, exp_avg_sq")


def _product(dims) -> int:
    n = 1
    for _, size in dims:
        n *= size
    return n


def _dims_text(dims) -> str:
    return ", ".join(f"{name} {size}" for name, size in dims)


def validate_mesh_placement(placement: Placement, model: Model, module: Module) -> None:
    """The mesh-layout rules above for one placement (module docstring)."""
    layout = placement.layout
    ms = placement.model_stage
    if layout is None:
        raise SemanticError(f"{model.name} is a tensors model: {ms} needs a mesh layout", placement.loc,
                            'place it like mesh (dp 2) on 0..1 { "*" shard(0) }', width=len(str(ms)))
    if not model.is_table:
        raise SemanticError(f"a mesh layout places a tensors model; {model.name} is a {model.architecture}",
                            layout.loc, f"place {ms} with dp, tp and pp")
    gpus = placement.gpus
    if _product(layout.dims) != len(gpus):
        loc, width = set_location(placement.gpu_set) if placement.gpu_set else (placement.loc, 1)
        raise SemanticError(f"mesh ({_dims_text(layout.dims)}) has {_product(layout.dims)} GPUs, the GPU set of {ms} "
                            f"{len(gpus)}", loc, "give the mesh as many GPUs as its sizes multiply to", width=width)
    names = [t.name for t in model.tensors]
    shapes = {t.name: t.shape for t in model.tensors}
    matched: set[str] = set()
    for rule in layout.rules:
        dims = rule.mesh.dims if rule.mesh is not None else layout.dims
        if rule.mesh is not None:
            if _product(dims) != len(rule.mesh.gpus):
                raise SemanticError(f"mesh ({_dims_text(dims)}) of the rule \"{rule.pattern}\" has {_product(dims)} "
                                    f"GPUs, its set {len(rule.mesh.gpus)}", rule.mesh.loc,
                                    "give the mesh as many GPUs as its sizes multiply to", width=4)
            outside = [g for g in rule.mesh.gpus if g not in gpus]
            if outside:
                raise SemanticError(f"GPU {outside[0]} of the rule \"{rule.pattern}\" is not in the GPU set of {ms}",
                                    rule.mesh.loc, "a rule's mesh is a part of the placement's GPUs", width=4)
        if len(rule.placements) != len(dims):
            raise SemanticError(f"the rule \"{rule.pattern}\" gives {len(rule.placements)} placement"
                                f"{'s' if len(rule.placements) != 1 else ''} for a mesh of {len(dims)} dimension"
                                f"{'s' if len(dims) != 1 else ''} ({_dims_text(dims)})", rule.loc,
                                "give one of replicate, shard(DIM), strided(DIM, SPLIT) per mesh dimension, in order",
                                width=len(rule.pattern) + 2)
        hits = [n for n in names if n not in matched and fnmatch.fnmatchcase(n, rule.pattern)]
        if not hits and not any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
            raise SemanticError(f"the rule \"{rule.pattern}\" matches no tensor of {model.name}", rule.loc,
                                did_you_mean(rule.pattern, names) + "patterns match whole names: * any text, "
                                "? one character", width=len(rule.pattern) + 2)
        for name in hits:
            for p in rule.placements:
                if p.kind != "replicate" and p.dim >= len(shapes[name]):
                    raise SemanticError(f"{p} splits dimension {p.dim} of {name}, which has "
                                        f"{len(shapes[name])}", p.loc,
                                        f"dimensions of {name} run 0..{len(shapes[name]) - 1}", width=len(p.kind))
        matched.update(hits)
    missing = [n for n in names if n not in matched]
    if missing:
        raise SemanticError(f"no layout rule of {ms} matches tensor {missing[0]}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), layout.loc,
                            'add a rule for it, e.g. "*" with replicate for every mesh dimension')
    _check_contract(placement, model, layout)


def _check_contract(placement: Placement, model: Model, layout: MeshLayout) -> None:
    """Every tensor's boxes on every GPU follow the local shard contract."""
    from .mesh import StridedLayoutError, mesh_boxes, rule_for

    for tensor in model.tensors:
        for rank in range(len(placement.gpus)):
            try:
                mesh_boxes(tensor.name, tensor.shape, placement, rank)
            except StridedLayoutError as error:
                rule = rule_for(layout, tensor.name)[1]
                raise SemanticError(f"{tensor.name} on GPU {placement.gpus[rank]}: {error}", rule.loc,
                                    "a shard may take several ranges of dimension 0 only (its boxes are stacked "
                                    "along dim 0); split other dimensions with shard(DIM)",
                                    width=len(rule.pattern) + 2) from None
