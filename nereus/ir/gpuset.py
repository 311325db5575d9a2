"""GPU sets: `0..63`, `0..31, 48..63`, `3, 2, 1, 0`, `n2..n3`, `n2`, `n2:0..3`, `n2:5`.

A set is an ordered list of items; its order is the mesh order of the placement (replica
major, then pipeline stage, then TP rank). Ranges are inclusive and may run downwards
(`3..0` is 3, 2, 1, 0). Node items expand to global GPU ids with the cluster's
gpus_per_node: GPU g of node n is n * gpus_per_node + g.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .diagnostics import SemanticError
from .model import Cluster, GpuSetItem, Location


def _span(lo: int, hi: int) -> range:
    return range(lo, hi + 1) if lo <= hi else range(lo, hi - 1, -1)


def format_item(item: GpuSetItem) -> str:
    """One item as written: `5`, `0..7`, `n2`, `n2..n3`, `n2:5`, `n2:0..3`."""
    if item.kind == "id":
        return str(item.lo)
    if item.kind == "range":
        return f"{item.lo}..{item.hi}"
    if item.kind == "nodes":
        return f"n{item.lo}" if item.lo == item.hi else f"n{item.lo}..n{item.hi}"
    if item.kind == "node_gpus":
        local = str(item.lo) if item.lo == item.hi else f"{item.lo}..{item.hi}"
        return f"n{item.node}:{local}"
    raise ValueError(f"unknown GPU set item kind {item.kind!r}")


def format_gpu_set(items: Iterable[GpuSetItem]) -> str:
    """A whole set as written, items joined by `, `."""
    return ", ".join(format_item(item) for item in items)


def items_for(gpus: Iterable[int]) -> tuple[GpuSetItem, ...]:
    """The shortest list of id/range items that spells `gpus` in order (used to print a
    placement that code built without a written set): ascending runs become `lo..hi`."""
    items: list[GpuSetItem] = []
    run: list[int] = []
    for gpu in gpus:
        if run and gpu == run[-1] + 1:
            run.append(gpu)
            continue
        if run:
            items.append(_run_item(run))
        run = [gpu]
    if run:
        items.append(_run_item(run))
    return tuple(items)


def _run_item(run: list[int]) -> GpuSetItem:
    if len(run) == 1:
        return GpuSetItem("id", run[0], run[0])
    return GpuSetItem("range", run[0], run[-1])


def _item_width(item: GpuSetItem) -> int:
    return len(format_item(item))


def _runs(what: str, first: str, last: str, shape: str) -> str:
    if first == last:
        return f"{shape}: the only {what.replace('GPU ids', 'GPU id').replace('GPUs', 'GPU').rstrip('s')} is {first}"
    return f"{shape}: {what} run {first}..{last}"


def expand_item(item: GpuSetItem, cluster: Cluster) -> list[int]:
    """The global GPU ids of one item, in order; SemanticError at the item if a GPU or
    node does not exist in `cluster`."""
    total, per_node, nodes = cluster.num_gpus, cluster.gpus_per_node, cluster.nodes
    shape = f"cluster {cluster.name} has {nodes} node{'s' if nodes != 1 else ''} x {per_node} GPUs"
    if item.kind in ("id", "range"):
        bad = max(item.lo, item.hi)
        if bad >= total:
            raise SemanticError(f"GPU {bad} does not exist", item.loc,
                                _runs("GPU ids", "0", str(total - 1), shape), width=_item_width(item))
        return list(_span(item.lo, item.hi))
    if item.kind == "nodes":
        bad = max(item.lo, item.hi)
        if bad >= nodes:
            raise SemanticError(f"node n{bad} does not exist", item.loc,
                                _runs("nodes", "n0", f"n{nodes - 1}", shape), width=_item_width(item))
        return [node * per_node + g for node in _span(item.lo, item.hi) for g in range(per_node)]
    if item.kind == "node_gpus":
        if item.node >= nodes:
            raise SemanticError(f"node n{item.node} does not exist", item.loc,
                                _runs("nodes", "n0", f"n{nodes - 1}", shape), width=_item_width(item))
        bad = max(item.lo, item.hi)
        if bad >= per_node:
            raise SemanticError(f"node n{item.node} has no GPU {bad}", item.loc,
                                _runs("GPUs of a node", "0", str(per_node - 1), shape), width=_item_width(item))
        return [item.node * per_node + g for g in _span(item.lo, item.hi)]
    raise ValueError(f"unknown GPU set item kind {item.kind!r}")


def resolve_gpu_set(items: Iterable[GpuSetItem], cluster: Cluster, owner: str = "this set") -> tuple[int, ...]:
    """Input: the items of a set as written, and the cluster. Output: the ordered global
    GPU ids. Invariant: every id exists in the cluster and appears once; otherwise a
    SemanticError at the offending item (`owner` names the model-stage in the message)."""
    items = tuple(items)
    gpus: list[int] = []
    for item in items:
        gpus.extend(expand_item(item, cluster))
    if len(set(gpus)) == len(gpus):  # the common case, checked without a per-GPU loop
        return tuple(gpus)
    seen: dict[int, GpuSetItem] = {}
    for item in items:
        for gpu in expand_item(item, cluster):
            if gpu in seen:
                first = seen[gpu]
                where = f" ({first.loc.line}:{first.loc.column})" if first.loc is not None else ""
                raise SemanticError(f"GPU {gpu} appears twice in {owner}", item.loc,
                                    f"'{format_item(first)}'{where} already includes GPU {gpu}",
                                    width=_item_width(item))
            seen[gpu] = item
    raise AssertionError("unreachable: a duplicate GPU was counted but not found")


def set_location(items: tuple[GpuSetItem, ...]) -> tuple[Optional[Location], int]:
    """The location of a written set and its width in columns (to the end of the last item
    when the set is on one line), for errors about the set as a whole."""
    if not items or items[0].loc is None:
        return None, 1
    first, last = items[0], items[-1]
    if last.loc is not None and last.loc.line == first.loc.line:
        return first.loc, last.loc.column + _item_width(last) - first.loc.column
    return first.loc, _item_width(first)
