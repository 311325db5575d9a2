"""Graphviz view of a transition: one cluster per round, one node per (round, op kind,
model-stage) with its count and bytes, coloured by kind; solid edges alloc → transfer →
free inside a model-stage, red dashed resource edges free → alloc labelled with their class
and count. Aggregating keeps a 64-GPU, 7-model-stage transition readable (tens of nodes,
not thousands); `dot -Tsvg` renders it.
"""

from __future__ import annotations

from collections import defaultdict

from .text import human_bytes

COLOURS = {"alloc": "#9ecae1", "keep": "#d9d9d9", "copy": "#a1d99b", "send": "#fdae6b", "stage_out": "#bcbddc",
           "free": "#fc9272"}
ORDER = ("alloc", "keep", "copy", "send", "stage_out", "free")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def program_dot(program) -> str:
    """DOT text of a lowered `Program` (module docstring)."""
    dag = program.dag
    counts: dict = defaultdict(lambda: [0, 0])
    for k, kind, record in program.ops():
        if kind == "alloc":
            items = [(dag.allocs[record].stage, dag.allocs[record].bytes)]
        elif kind in ("free", "stage_out"):
            items = [(dag.frees[record].stage, dag.frees[record].bytes)]
        elif kind == "send":
            items = [(x.stage, x.bytes) for x in record.xfers]
        else:
            items = [(record.stage, record.bytes)]
        for stage, nbytes in items:
            entry = counts[(k, kind, stage)]
            entry[0] += 1
            entry[1] += nbytes
    lines = [f"digraph {_quote(f'{dag.source} -> {dag.target}')} {{", "  rankdir=LR;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    by_round: dict = defaultdict(list)
    for key in sorted(counts, key=lambda t: (t[0], t[2], ORDER.index(t[1]))):
        by_round[key[0]].append(key)
    node = {}
    for k in sorted(by_round):
        lines.append(f"  subgraph cluster_round{k} {{")
        lines.append(f'    label="round {k}"; style=dashed;')
        for key in by_round[k]:
            _, kind, stage = key
            n, nbytes = counts[key]
            name = f"r{k}_{kind}_{stage}"
            node[key] = name
            label = f"{kind} {dag.stages[stage].name}\\n×{n}  {human_bytes(nbytes)}"
            lines.append(f'    {name} [label="{label}", fillcolor="{COLOURS[kind]}"];')
        lines.append("  }")
    for k in sorted(by_round):
        stages = sorted({key[2] for key in by_round[k]})
        for stage in stages:
            chain = [node[(k, kind, stage)] for kind in ORDER if (k, kind, stage) in node]
            for a, b in zip(chain, chain[1:]):
                lines.append(f"  {a} -> {b};")
    resource: dict = defaultdict(int)
    round_of_free = {f: k for k, rnd in enumerate(program.schedule.rounds) for f in rnd.frees + rnd.stage_outs}
    round_of_alloc = {a: k for k, rnd in enumerate(program.schedule.rounds) for a in rnd.allocs}
    for e in program.schedule.edges:
        kf = round_of_free.get(e.free)
        ka = round_of_alloc.get(e.alloc)
        f_kind = "stage_out" if e.free in program.schedule.rounds[kf].stage_outs else "free"
        src = node.get((kf, f_kind, dag.frees[e.free].stage))
        dst = node.get((ka, "alloc", dag.allocs[e.alloc].stage))
        if src and dst:
            resource[(src, dst, e.kind)] += 1
    for (src, dst, kind), n in sorted(resource.items()):
        lines.append(f'  {src} -> {dst} [color=red, style=dashed, fontsize=8, label="{kind} ×{n}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
