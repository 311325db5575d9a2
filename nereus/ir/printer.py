"""Module → canonical `.nir` text.

Canonical form: the style of docs/ir.md's examples; 2-space indent; declarations grouped as
cluster, models, workload, plans, transitions, each group in declaration order and
separated by a blank line; sizes and rates in their most readable exact unit; model and
plan columns aligned; a derived plan (`plan S2 = S1 {`) prints only its own entries; an
alias model prints only the keys that differ from its base; defaults (reserve 0%,
recompute none, head lm, tp 1, pp 1) are left out. Invariant: `parse_source(print_module(m))
== m` for every valid module m, and printing is idempotent.

Every printed line carries an *anchor* (("cluster", "intra"), ("plan", "S1",
"actor.training"), ...) so that comments of the source can be put back next to what they
annotated (`nereus.ir.comments`); the Module itself holds no comments.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from .gpuset import format_gpu_set, items_for
from .model import ARCHITECTURE_DEFAULTS, Cluster, Model, Module, Placement, Plan, RopeScaling, Workload
from .units import format_flops, format_fraction, format_number, format_rate, format_size

_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype", "head", "head_dim", "rope_theta",
               "rope_scaling", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "experts", "experts_per_token",
               "expert_ffn", "norm_topk_prob")
_ALWAYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype")  # of a hand-written model
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Model) if f.default is not dataclasses.MISSING}

Anchor = tuple[str, ...]
Line = tuple[Anchor, str]


def print_cluster(cluster: Cluster) -> list[Line]:
    gpu = cluster.gpu
    top: Anchor = ("cluster",)
    lines = [
        (top, f"cluster {cluster.name} {{"),
        (("cluster", "nodes"), f"  nodes {cluster.nodes}"),
        (("cluster", "gpus_per_node"), f"  gpus_per_node {cluster.gpus_per_node}"),
        (("cluster", "gpu"), f"  gpu {{ mem {format_size(gpu.mem_bytes)}  flops {format_flops(gpu.flops)}  "
                             f"hbm {format_rate(gpu.hbm_bytes_per_s)} }}"),
        (("cluster", "intra"), f"  intra {format_rate(cluster.intra_bytes_per_s)}"),
        (("cluster", "inter"), f"  inter {format_rate(cluster.inter_bytes_per_s)}"),
        (("cluster", "host_mem"), f"  host_mem {format_size(cluster.host_mem_bytes)}"),
    ]
    if cluster.reserve:
        lines.append((("cluster", "reserve"), f"  reserve {format_fraction(cluster.reserve)}"))
    return lines + [(("cluster", "}"), "}")]


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_number(value)
    if isinstance(value, RopeScaling):
        return (f"{{ type {value.type} factor {format_number(value.factor)} low_freq_factor "
                f"{format_number(value.low_freq_factor)} high_freq_factor {format_number(value.high_freq_factor)} "
                f"original_max_position_embeddings {value.original_max_position_embeddings} }}")
    return "none" if value is None else str(value)


def _implied_head_dim(reference: dict, hidden: int, heads: int):
    """The head_dim a declaration gets without writing it (mirrors build.py): its
    reference's when that is not the reference's hidden / heads, else hidden / heads of
    its own sizes."""
    given = reference.get("head_dim")
    if given is not None and given * reference.get("heads", 0) != reference.get("hidden"):
        return given
    return hidden // heads if heads > 0 and hidden % heads == 0 else None


def _model_body(model: Model, base: Optional[Model]) -> str:
    """The `{ ... }` keys of a model: those that differ from what its right-hand side
    gives (an alias: its base; `hf(...)`: the checkpoint's config; an architecture: the
    family's defaults, sizes and dtype always written, as they size every tensor)."""
    if base is not None:
        reference = {key: getattr(base, key) for key in _MODEL_KEYS}
    elif model.checkpoint is not None:
        reference = {**_DEFAULTS, **ARCHITECTURE_DEFAULTS.get(model.architecture, {}), **dict(model.checkpoint_fields)}
        if not model.checkpoint_fields:  # built by code: what the config gives is unknown, write every key
            reference = {}
    else:
        reference = {**_DEFAULTS, **ARCHITECTURE_DEFAULTS.get(model.architecture, {}), "head_dim": None}
    if reference:
        reference["head_dim"] = _implied_head_dim(reference, model.hidden, model.heads)
    keys = [key for key in _MODEL_KEYS if key not in reference or getattr(model, key) != reference[key]
            or (base is None and model.checkpoint is None and key in _ALWAYS)]
    if not keys:
        return ""
    return " { " + " ".join(f"{key} {_value(getattr(model, key))}" for key in keys) + " }"


def print_models(models: tuple[Model, ...]) -> list[Line]:
    width = max((len(model.name) for model in models), default=0)
    by_name = {model.name: model for model in models}
    lines = []
    for model in models:
        base = by_name.get(model.base) if model.base else None
        if model.is_table and base is None:
            lines.extend(print_table(model, width))
            continue
        head = model.base if base is not None else \
            f'hf("{model.checkpoint}")' if model.checkpoint is not None else model.architecture
        lines.append((("model", model.name), f"model {model.name:<{width}} = {head}{_model_body(model, base)}"))
    return lines


def print_table(model: Model, width: int = 0) -> list[Line]:
    """A `tensors` model on several lines: dtype, states and its tensors, those that differ
    in one whole number of their name only and share a shape grouped as `{lo..hi}`
    (nereus.ir.tablegroup)."""
    from .tablegroup import grouped_names

    anchor: Anchor = ("model", model.name)
    lines = [(anchor, f"model {model.name:<{width}} = tensors {{"), (anchor + ("dtype",), f"  dtype {model.dtype}")]
    if model.states:
        lines.append((anchor + ("states",), f"  states: {', '.join(model.states)}"))
    rows = [(f'"{name}"', "[" + ", ".join(map(str, shape)) + "]") for name, shape in grouped_names(model.tensors)]
    name_width = max(len(name) for name, _ in rows)
    lines.extend((anchor + ("tensor", str(i)), f"  tensor {name:<{name_width}} {shape}")
                 for i, (name, shape) in enumerate(rows))
    return lines + [(anchor + ("}",), "}")]


def print_workload(workload: Workload) -> list[Line]:
    lines = [
        (("workload",), f"workload {workload.name} {{"),
        (("workload", "counts"), f"  batch {workload.batch}  prompt {workload.prompt}  response {workload.response}  "
                                 f"microbatch {workload.microbatch}"),
    ]
    if workload.recompute != "none":
        lines.append((("workload", "recompute"), f"  recompute {workload.recompute}"))
    width = max((len(stage) + 1 for stage, _ in workload.stages), default=0)
    for stage, models in workload.stages:
        lines.append((("workload", stage), f"  {stage + ':':<{width}} {', '.join(models)}"))
    return lines + [(("workload", "}"), "}")]


def _mesh_cells(placement: Placement) -> tuple[str, ...]:
    tp = f"tp {placement.tp}" if placement.tp != 1 else ""
    pp = f"pp {placement.pp}" if placement.pp != 1 else ""
    ep = f"ep {placement.ep}" if placement.ep != 1 else ""
    return f"dp {placement.dp}", tp, pp, ep


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells padded into columns two spaces apart; empty columns dropped."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths) if width).rstrip() for row in rows]


def print_plan(plan: Plan) -> list[Line]:
    head = f"plan {plan.name} = {plan.base} {{" if plan.base else f"plan {plan.name} {{"
    anchor: Anchor = ("plan", plan.name)
    entries = plan.declared
    if not entries:
        return [(anchor, head + " }")]
    body: list[Line] = []
    for p, line in zip(entries, placement_lines(entries)):
        placed = anchor + (str(p.model_stage),)
        if p.layout is None:
            body.append((placed, f"  {line}"))
            continue
        body.append((placed, f"  {line} {{"))
        cells = [(f'"{r.pattern}"', f"mesh ({_dims(r.mesh.dims)}) on {format_gpu_set(r.mesh.gpu_set or items_for(r.mesh.gpus))}"
                  if r.mesh is not None else "") + tuple(str(x) for x in r.placements) for r in p.layout.rules]
        most = max(len(c) for c in cells)
        rules = [c + ("",) * (most - len(c)) for c in cells]
        body.extend((placed + ("rule", str(i)), f"    {text}") for i, text in enumerate(_aligned(rules)))
        body.append((placed + ("}",), "  }"))
    return [(anchor, head)] + body + [(anchor + ("}",), "}")]


def placement_lines(placements: Sequence[Placement]) -> list[str]:
    """The plan lines of `placements` (no indent), aligned into columns as in a plan; a
    mesh layout's line is its first (its rules follow it in a plan)."""
    classic = [_mesh_cells(p) for p in placements if p.layout is None]
    mesh_widths = [max((len(cells[i]) for cells in classic), default=0) for i in range(4)]
    rows = []
    for p in placements:
        if p.layout is None:
            mesh = " ".join(cell.ljust(width) for cell, width in zip(_mesh_cells(p), mesh_widths) if width)
        else:
            mesh = f"mesh ({_dims(p.layout.dims)})"
        gpus = format_gpu_set(p.gpu_set or items_for(p.gpus))
        flags = " ".join(f for f in ("offload" if p.offload else "", f"zero {p.zero}" if p.zero else "",
                                     f"quant {p.quant}" if p.quant else "") if f)
        rows.append((str(p.model_stage), mesh, f"on {gpus}", flags))
    return _aligned(rows)


def _dims(dims) -> str:
    return ", ".join(f"{name} {size}" for name, size in dims)


def print_lines(module: Module) -> list[list[Line]]:
    """The canonical text as groups (separated by blank lines) of anchored lines."""
    groups = [print_cluster(module.cluster)]
    if module.models:
        groups.append(print_models(module.models))
    groups.append(print_workload(module.workload))
    groups.extend(print_plan(plan) for plan in module.plans)
    if module.transitions:
        groups.append([(("transition", t.source, t.target), f"transition {t.source} -> {t.target}")
                       for t in module.transitions])
    return groups


def _indent(text: str) -> str:
    return text[: len(text) - len(text.lstrip())]


def _comment_block(comments: Sequence[str]) -> list[str]:
    """[comments as one block of lines, its trailing blank lines dropped], or [] for none."""
    comments = list(comments)
    while comments and not comments[-1]:
        comments.pop()
    return ["\n".join(comments)] if comments else []


def print_module(module: Module, before: Optional[Mapping[Anchor, Sequence[str]]] = None,
                 after: Optional[Mapping[Anchor, Sequence[str]]] = None,
                 tail: Sequence[str] = (), head: Sequence[str] = ()) -> str:
    """Input: a Module; optionally comments to put back: `before[anchor]` on lines of their
    own above the anchored line, `after[anchor]` at the end of it, `tail` at the end of
    the file, `head` at its top. Output: the canonical source text, ending in one newline."""
    before, after = before or {}, after or {}
    out: list[str] = _comment_block(head)
    for group in print_lines(module):
        lines = []
        for anchor, text in group:
            indent = _indent(text) if not text.startswith("}") else "  "
            lines.extend(indent + comment if comment else "" for comment in before.get(anchor, ()))
            trailing = after.get(anchor, ())
            lines.append(text + ("  " + " ".join(trailing) if trailing else ""))
        out.append("\n".join(lines))
    out += _comment_block(tail)
    return "\n\n".join(out) + "\n"
