"""Module layouts → `.nir` text: `tensors` models and mesh-layout plans (docs/ir.md).

Input: one or more `ModuleLayout`s of the same module (nereus.interop.layouts) and the
machine they run on. Output: a whole `.nir` file: a cluster of the world's GPUs, one
`tensors` model per group of tensors sharing a dtype and optimizer states (most models
have one), a workload that trains them, and one plan per layout. Invariant: parsing the
text gives, for every tensor and rank, the boxes DTensor gives that rank (each tensor's
rule has its mesh and placements; rules are as compact as that allows: a name with its
numbers as `*` where every tensor it matches is laid out alike, the most common layout
last as `"*"`).
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from dataclasses import dataclass, replace

from nereus.ir.gpuset import format_gpu_set, items_for
from nereus.ir.table import natural_key
from nereus.ir.tablegroup import grouped_names
from nereus.ir.model import DimPlacement, TensorDecl
from nereus.ir.units import format_rate, format_size

from .errors import InteropError
from .layouts import ModuleLayout, TensorLayout, rank_boxes


@dataclass(frozen=True)
class Machine:
    """What the cluster block says: the world's shape and, per GPU, the memory the
    transition may use (its free memory plus the state it moves), and rates for the
    cost model's prediction."""

    nodes: int
    gpus_per_node: int
    mem_bytes: int
    host_mem_bytes: int
    intra_bytes_per_s: float = 100e9
    inter_bytes_per_s: float = 25e9
    hbm_bytes_per_s: float = 1e12
    flops: float = 100e12


def model_groups(layout: ModuleLayout, base: str) -> list[tuple[str, str, tuple[str, ...], list[str]]]:
    """[(model name, dtype, states, tensor names)]: tensors grouped by dtype and optimizer
    states, the largest group named `base`, the others `base_1`, `base_2`, ..."""
    groups: dict[tuple, list[str]] = {}
    for t in layout.tensors:
        groups.setdefault((t.dtype, t.states), []).append(t.name)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return [(base if i == 0 else f"{base}_{i}", dtype, states, names)
            for i, ((dtype, states), names) in enumerate(ordered)]


def _escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _dims(dims) -> str:
    return ", ".join(f"{n} {s}" for n, s in dims)


def _gpus(gpus) -> str:
    return format_gpu_set(items_for(gpus))


def _on_default(t: TensorLayout, default: tuple) -> TensorLayout:
    """`t` laid out on the `default` mesh when some placements there give every GPU the
    same boxes (FSDP2 over TP puts an embedding on each rank's dp column, `(rep 2, dp 2)
    on 0, 2, 1, 3`, which on the (dp 2, tp 2) mesh is shard(0), replicate); else `t`."""
    dims, gpus = default
    if t.mesh_key == default or set(t.gpus) != set(gpus):
        return t
    options = [DimPlacement("replicate")] + [p for p in dict.fromkeys(t.placements) if p.kind != "replicate"]
    wanted = {g: rank_boxes(t, g) for g in gpus}
    for choice in itertools.product(options, repeat=len(dims)):
        if sum(p.kind != "replicate" for p in choice) != sum(p.kind != "replicate" for p in t.placements):
            continue
        candidate = replace(t, dims=dims, gpus=gpus, placements=choice)
        try:
            if all(rank_boxes(candidate, g) == wanted[g] for g in gpus):
                return candidate
        except InteropError:
            continue
    return t


def _rules(tensors: list[TensorLayout], default: tuple) -> list[str]:
    """Rule lines for `tensors` (see the module docstring); `default` is the placement's
    mesh key: rules on it name no mesh of their own."""
    classes: dict[tuple, list[TensorLayout]] = {}
    for t in tensors:
        t = _on_default(t, default)
        classes.setdefault((t.mesh_key, t.placements), []).append(t)
    names = [t.name for t in tensors]
    catch_all = max(classes, key=lambda key: (len(classes[key]), key[0] == default))
    lines = []
    for key, members in classes.items():
        if key == catch_all:
            continue
        mine = {t.name for t in members}
        patterns: list[str] = []
        for t in members:
            pattern = re.sub(r"[0-9]+", "*", _escape(t.name))
            if pattern in patterns:
                continue
            if not set(fnmatch.filter(names, pattern)) <= mine:
                pattern = _escape(t.name)
            if pattern not in patterns:
                patterns.append(pattern)
        lines.extend(_rule(p, key, default) for p in patterns)
    lines.append(_rule("*", catch_all, default))
    return _aligned(lines)


def _rule(pattern: str, key: tuple, default: tuple) -> tuple:
    (dims, gpus), placements = key
    mesh = "" if (dims, gpus) == default else f"mesh ({_dims(dims)}) on {_gpus(gpus)}"
    return (f'"{pattern}"', mesh) + tuple(str(p) for p in placements)


def _aligned(rows: list[tuple]) -> list[str]:
    most = max(len(r) for r in rows)
    rows = [r + ("",) * (most - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(most)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths) if w).rstrip() for r in rows]


def _default_mesh(tensors: list[TensorLayout], world: int) -> tuple:
    """The placement's mesh: the one most tensors live on when it covers every GPU the
    tensors use, else a flat mesh of the world."""
    counts: dict[tuple, int] = {}
    for t in tensors:
        counts[t.mesh_key] = counts.get(t.mesh_key, 0) + 1
    best = max(counts, key=lambda key: (counts[key], key))
    used = {g for t in tensors for g in t.gpus}
    if used <= set(best[1]):
        return best
    return (("world", world),), tuple(range(world))


def cluster_text(machine: Machine, name: str = "here") -> str:
    return (f"cluster {name} {{\n  nodes {machine.nodes}\n  gpus_per_node {machine.gpus_per_node}\n"
            f"  gpu {{ mem {format_size(machine.mem_bytes)}  flops {int(machine.flops // 10**12) or 1}TFLOPS  "
            f"hbm {format_rate(machine.hbm_bytes_per_s)} }}\n"
            f"  intra {format_rate(machine.intra_bytes_per_s)}\n  inter {format_rate(machine.inter_bytes_per_s)}\n"
            f"  host_mem {format_size(machine.host_mem_bytes)}\n}}\n")


def module_text(layouts: dict[str, ModuleLayout], machine, base: str = "module",
                transitions: tuple = ()) -> str:
    """A whole `.nir` file: `layouts` ({plan name: layout}, all of one module; the first
    layout's optimizer states count for every plan) as plans, and `transitions` ((from,
    to), ...). With `machine` None, the file without its cluster block."""
    first = next(iter(layouts.values()))
    groups = model_groups(first, base)
    by_plan = {plan: layout.by_name() for plan, layout in layouts.items()}
    out = [cluster_text(machine)] if machine is not None else []
    for model, dtype, states, names in groups:
        table = [TensorDecl(n, first.by_name()[n].shape) for n in sorted(names, key=natural_key)]
        lines = [f"model {model} = tensors {{", f"  dtype {dtype}"]
        if states:
            lines.append(f"  states: {', '.join(states)}")
        rows = [(f'"{pattern}"', "[" + ", ".join(map(str, shape)) + "]") for pattern, shape in grouped_names(table)]
        width = max(len(r[0]) for r in rows)
        lines.extend(f"  tensor {name:<{width}} {shape}" for name, shape in rows)
        out.append("\n".join(lines) + "\n}\n")
    models = ", ".join(model for model, *_ in groups)
    out.append(f"workload interop {{\n  batch 1  prompt 1  response 1  microbatch 1\n  training: {models}\n}}\n")
    for plan, tensors in by_plan.items():
        lines = [f"plan {plan} {{"]
        for model, _, states, names in groups:
            mine = [tensors[n] for n in names]
            default = _default_mesh(mine, first.world)
            lines.append(f"  {model}.training  mesh ({_dims(default[0])})  on {_gpus(default[1])} {{")
            lines.extend(f"    {rule}" for rule in _rules(mine, default))
            lines.append("  }")
        out.append("\n".join(lines) + "\n}\n")
    if transitions:
        out.append("\n".join(f"transition {a} -> {b}" for a, b in transitions) + "\n")
    return "\n".join(out)
