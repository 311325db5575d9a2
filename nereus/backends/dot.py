"""Graphviz view of a lowered transition program: `nereusc FILE --transition S1:S2 --emit dot`.

Input: a `Program` (nereus.passes.lower). Output: DOT text; `dot -Tsvg` renders it.

Nodes: one per (round, op kind, model-stage), labelled with the op count and bytes and
coloured by kind; one cluster per round. Aggregating keeps an 8B, 64-GPU, 7-model-stage
transition legible (about a hundred nodes, not thousands of ops).

Edges: every dependency of the program, aggregated between the nodes of its ops and
labelled with a count when more than one op pair shares it:
  - data (solid black): alloc → the keep / copy / send that writes into that after shard →
    the free (or stage_out) of the before shard it read; stage_out → the later free of the
    staged shard;
  - round order (dotted grey): a model-stage's nodes in execution order (rounds are
    barriers: round k+1 starts when every rank finished round k);
  - resource (dashed, one colour per class): free → the alloc that waited for its memory,
    from the resources pass (same-model-stage, same-model-cross-stage, cross-model-same-stage,
    cross-model-cross-stage).
Invariant: every node has at least one edge unless its model-stage has a single op node.
"""

from __future__ import annotations

from collections import defaultdict

from nereus.ir.units import human_bytes

COLOURS = {"alloc": "#9ecae1", "keep": "#d9d9d9", "copy": "#a1d99b", "send": "#fdae6b", "stage_out": "#bcbddc",
           "free": "#fc9272"}
ORDER = ("alloc", "keep", "copy", "send", "stage_out", "free")
EDGE_STYLES = {
    "data": 'color="black", style=solid',
    "round": 'color="grey60", style=dotted',
    "same-model-stage": 'color="#e41a1c", style=dashed',
    "same-model-cross-stage": 'color="#984ea3", style=dashed',
    "cross-model-same-stage": 'color="#ff7f00", style=dashed',
    "cross-model-cross-stage": 'color="#377eb8", style=dashed',
}
LEGEND = ("solid: data (alloc -> transfer -> free); dotted grey: round order of a model-stage; dashed: resource "
          "edges free -> alloc (red same-model-stage, purple same-model-cross-stage, orange cross-model-same-stage, "
          "blue cross-model-cross-stage)")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _node_ops(program) -> dict:
    """(round, kind, stage) → [count, bytes] over the program's ops."""
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
    return counts


def _edges(program) -> dict:
    """(from node key, to node key, class) → number of op pairs behind the edge."""
    dag, schedule = program.dag, program.schedule
    alloc_round = {a: k for k, rnd in enumerate(schedule.rounds) for a in rnd.allocs}
    free_round = {f: k for k, rnd in enumerate(schedule.rounds) for f in rnd.frees}
    out_round = {f: k for k, rnd in enumerate(schedule.rounds) for f in rnd.stage_outs}

    def release(f: int) -> tuple:  # the node that ended a before shard's life on its GPU
        if f in out_round:
            return out_round[f], "stage_out", dag.frees[f].stage
        return free_round[f], "free", dag.frees[f].stage

    edges: dict = defaultdict(int)
    for k, kind, record in program.ops():
        xfers = record.xfers if kind == "send" else (record,) if kind in ("keep", "copy") else ()
        for x in xfers:
            here = (k, kind, x.stage)
            edges[((alloc_round[x.alloc], "alloc", x.stage), here, "data")] += 1
            edges[(here, release(x.free), "data")] += 1
    for f, k in out_round.items():
        edges[((k, "stage_out", dag.frees[f].stage), (free_round[f], "free", dag.frees[f].stage), "data")] += 1
    for e in schedule.edges:
        edges[(release(e.free), (alloc_round[e.alloc], "alloc", dag.allocs[e.alloc].stage), e.kind)] += 1
    return edges


def program_dot(program) -> str:
    """DOT text of a lowered `Program` (module docstring)."""
    dag = program.dag
    counts = _node_ops(program)
    keys = sorted(counts, key=lambda t: (t[0], t[2], ORDER.index(t[1])))
    name = {key: f"r{key[0]}_{key[1]}_{key[2]}" for key in keys}
    lines = [f"digraph {_quote(f'{dag.source} -> {dag.target}')} {{", "  rankdir=LR; newrank=true;",
             f"  label={_quote(LEGEND)}; labelloc=b; fontname=\"Helvetica\"; fontsize=9;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8];']
    for k in sorted({key[0] for key in keys}):
        lines.append(f"  subgraph cluster_round{k} {{")
        lines.append(f'    label="round {k}"; style=dashed;')
        for key in (key for key in keys if key[0] == k):
            _, kind, stage = key
            n, nbytes = counts[key]
            label = f"{kind} {dag.stages[stage].name}\\n×{n}  {human_bytes(nbytes)}"
            lines.append(f'    {name[key]} [label="{label}", fillcolor="{COLOURS[kind]}"];')
        lines.append("  }")
    edges = _edges(program)
    by_stage: dict = defaultdict(list)
    for key in keys:  # execution order: round, then phase
        by_stage[key[2]].append(key)
    for chain in by_stage.values():
        for a, b in zip(chain, chain[1:]):
            if (a, b, "data") not in edges:  # a data edge already orders them
                edges[(a, b, "round")] += 1
    for (a, b, kind), n in sorted(edges.items(), key=lambda item: (name[item[0][0]], name[item[0][1]], item[0][2])):
        label = f', label="×{n}"' if n > 1 else ""
        lines.append(f"  {name[a]} -> {name[b]} [{EDGE_STYLES[kind]}{label}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
