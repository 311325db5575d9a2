"""Tensor- and expert-parallel groups against node boundaries.

A TP group all-reduces activations twice per layer (four times in training) and an EP group
exchanges every MoE layer's tokens all-to-all: inside a node over NVLink, across nodes over
a link an order of magnitude slower (`intra` against `inter`). A placement whose TP (or EP)
group spans nodes is valid, so it is a warning, not an error: `nereusc check` and
`nereusc FILE` report it at the placement's GPU set (`node_span_warnings`).

Groups follow the mesh order (model.Placement): within pipeline stage p of replica r the
stage's ep·tp GPUs are gpus[(r·pp + p)·ep·tp ...], TP innermost: TP group (r, p, e) is the
tp consecutive GPUs of EP rank e; an EP group is the stage's ep·tp GPUs.
"""

from __future__ import annotations

from .diagnostics import NereusWarning
from .gpuset import format_gpu_set, items_for, set_location
from .model import Cluster, Module, Placement


def spanning_groups(cluster: Cluster, placement: Placement, kind: str = "tp") -> list[tuple[int, int, tuple[int, ...]]]:
    """(replica, pp stage, GPUs) of every `kind` ("tp" or "ep") group of `placement` whose
    GPUs are on more than one node, in mesh order; [] for groups of one GPU."""
    size = placement.tp if kind == "tp" else placement.tp * placement.ep
    if size == 1 or (kind == "ep" and placement.ep == 1):
        return []
    width, gpus = placement.stage_width, placement.gpus
    out = []
    for start in range(0, len(gpus), size):
        group = gpus[start:start + size]
        if len({cluster.node_of(g) for g in group}) > 1:
            stage_index = start // width
            out.append((stage_index // placement.pp, stage_index % placement.pp, group))
    return out


def _nodes(cluster: Cluster, gpus) -> str:
    nodes = sorted({cluster.node_of(g) for g in gpus})
    return ", ".join(map(str, nodes[:4])) + (", ..." if len(nodes) > 4 else "")


def _hint(cluster: Cluster, placement: Placement, kind: str) -> str:
    size = placement.tp if kind == "tp" else placement.tp * placement.ep
    per_node = cluster.gpus_per_node
    what = "tp" if kind == "tp" else "ep x tp"
    if size > per_node:
        article = "a" if kind == "tp" else "an"
        return f"{article} {what} of at most {per_node} (gpus_per_node) keeps each group in one node"
    ordered = tuple(sorted(placement.gpus))
    aligned = all(len({cluster.node_of(g) for g in ordered[i:i + size]}) == 1 for i in range(0, len(ordered), size))
    if aligned and ordered != placement.gpus:
        return f"a node-aligned set keeps each group in one node, e.g. on {format_gpu_set(items_for(ordered))}"
    return (f"a node-aligned set keeps each group in one node: every run of {size} consecutive GPUs of the set "
            f"(mesh order, TP innermost) on one node; or a smaller {what}")


def node_span_warnings(module: Module, source: str | None = None) -> list[NereusWarning]:
    """A warning at the GPU set of every written placement whose TP or EP groups span nodes
    (a placement inherited by `plan S2 = S1` warns once, where it is written)."""
    out = []
    cluster = module.cluster
    for plan in module.plans:
        for placement in plan.declared:
            for kind in ("tp", "ep"):
                groups = spanning_groups(cluster, placement, kind)
                if not groups:
                    continue
                if kind == "ep" and spanning_groups(cluster, placement, "tp"):
                    break  # said for its TP groups already, at the same set
                replica, stage, gpus = groups[0]
                total = len(placement.gpus) // (placement.tp if kind == "tp" else placement.stage_width)
                where = f"replica {replica}" + (f", pp stage {stage}" if placement.pp > 1 else "")
                shown = format_gpu_set(items_for(gpus))
                link = "all-reduces" if kind == "tp" else "all-to-all exchanges"
                loc, width = set_location(placement.gpu_set) if placement.gpu_set else (placement.loc, 1)
                out.append(NereusWarning(
                    f"{len(groups)} of {total} {kind.upper()} groups of {placement.model_stage} in plan {plan.name} "
                    f"span nodes: the first, {where}, has GPUs {shown} on nodes {_nodes(cluster, gpus)} "
                    f"(its {link} cross the inter-node network)",
                    loc, _hint(cluster, placement, kind), source, width=width))
    return out
