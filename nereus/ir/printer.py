"""Module → canonical `.nir` text.

Canonical form: the DESIGN.md example's style; 2-space indent; declarations grouped as
cluster, models, workload, plans, transitions, each group in declaration order and
separated by a blank line; sizes and rates in their shortest exact unit; model and plan
columns aligned; a derived plan (`plan S2 = S1 {`) prints only its own entries; an alias
model prints only the keys that differ from its base; defaults (reserve 0%, recompute
none, head lm, tp 1, pp 1) are left out. Invariant: `parse_source(print_module(m)) == m` for every
valid module m, and printing is idempotent.
"""

from __future__ import annotations

from .gpuset import format_gpu_set, items_for
from .model import Cluster, Model, Module, Placement, Plan, Workload
from .units import format_flops, format_fraction, format_rate, format_size

_MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype", "head")


def print_cluster(cluster: Cluster) -> list[str]:
    gpu = cluster.gpu
    lines = [
        f"cluster {cluster.name} {{",
        f"  nodes {cluster.nodes}",
        f"  gpus_per_node {cluster.gpus_per_node}",
        f"  gpu {{ mem {format_size(gpu.mem_bytes)}  flops {format_flops(gpu.flops)}  "
        f"hbm {format_rate(gpu.hbm_bytes_per_s)} }}",
        f"  intra {format_rate(cluster.intra_bytes_per_s)}",
        f"  inter {format_rate(cluster.inter_bytes_per_s)}",
        f"  host_mem {format_size(cluster.host_mem_bytes)}",
    ]
    if cluster.reserve:
        lines.append(f"  reserve {format_fraction(cluster.reserve)}")
    return lines + ["}"]


def _model_body(model: Model, base: Model | None) -> str:
    """The `{ ... }` keys of a model: all of them, or for an alias those that differ."""
    if base is None:  # dtype always (it sizes every tensor), head only when not the default
        keys = [key for key in _MODEL_KEYS if key != "head" or model.head != "lm"]
    else:
        keys = [key for key in _MODEL_KEYS if getattr(model, key) != getattr(base, key)]
    if not keys:
        return ""
    return " { " + " ".join(f"{key} {getattr(model, key)}" for key in keys) + " }"


def print_models(models: tuple[Model, ...]) -> list[str]:
    width = max((len(model.name) for model in models), default=0)
    by_name = {model.name: model for model in models}
    lines = []
    for model in models:
        base = by_name.get(model.base) if model.base else None
        head = model.base if base is not None else model.architecture
        lines.append(f"model {model.name:<{width}} = {head}{_model_body(model, base)}")
    return lines


def print_workload(workload: Workload) -> list[str]:
    lines = [
        f"workload {workload.name} {{",
        f"  batch {workload.batch}  prompt {workload.prompt}  response {workload.response}  "
        f"microbatch {workload.microbatch}",
    ]
    if workload.recompute != "none":
        lines.append(f"  recompute {workload.recompute}")
    width = max((len(stage) + 1 for stage, _ in workload.stages), default=0)
    for stage, models in workload.stages:
        lines.append(f"  {stage + ':':<{width}} {', '.join(models)}")
    return lines + ["}"]


def _mesh_cells(placement: Placement) -> tuple[str, str, str]:
    tp = f"tp {placement.tp}" if placement.tp != 1 else ""
    pp = f"pp {placement.pp}" if placement.pp != 1 else ""
    return f"dp {placement.dp}", tp, pp


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells padded into columns two spaces apart; empty columns dropped."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths) if width).rstrip() for row in rows]


def print_plan(plan: Plan) -> list[str]:
    head = f"plan {plan.name} = {plan.base} {{" if plan.base else f"plan {plan.name} {{"
    entries = plan.declared
    if not entries:
        return [head + " }"]
    meshes = [_mesh_cells(p) for p in entries]
    mesh_widths = [max(len(cells[i]) for cells in meshes) for i in range(3)]
    rows = []
    for p, cells in zip(entries, meshes):
        mesh = " ".join(cell.ljust(width) for cell, width in zip(cells, mesh_widths) if width)
        gpus = format_gpu_set(p.gpu_set or items_for(p.gpus))
        rows.append((str(p.model_stage), mesh, f"on {gpus}", "offload" if p.offload else ""))
    return [head] + [f"  {line}" for line in _aligned(rows)] + ["}"]


def print_module(module: Module) -> str:
    """Input: a Module. Output: its canonical source text, ending in one newline."""
    groups = [print_cluster(module.cluster)]
    if module.models:
        groups.append(print_models(module.models))
    groups.append(print_workload(module.workload))
    groups.extend(print_plan(plan) for plan in module.plans)
    if module.transitions:
        groups.append([f"transition {t.source} -> {t.target}" for t in module.transitions])
    return "\n\n".join("\n".join(group) for group in groups) + "\n"
