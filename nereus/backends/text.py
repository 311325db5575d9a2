"""Text listing of a lowered program: one line per symbolic op, rounds in order.

    transition S1 -> S2: 2 rounds, 3 messages, 4.0 MiB moved, 2.0 MiB sent (lower bound 2.0 MiB)
    round 0
      alloc     gpu 4   actor.training/1                         1.0 MiB
      keep      gpu 0   actor.training/0 -> actor.training/0     embed..head  12 pieces
      send      0 -> 4  2 transfers                              1.0 MiB
        actor.training/0 -> actor.training/1  layers 0..3  9 pieces  1.0 MiB
      free      gpu 0   actor.training/0                         2.0 MiB

Stable (the golden test compares it byte for byte); layer ranges are not expanded. A
round's allocs and frees of 0 bytes (units kept in place: nothing to allocate or free; a
16-GPU change listed 112 of each before its first real alloc) are folded into one line
each, where the first of them stood:

      alloc     112 units of 0 B (kept in place: nothing to allocate), not listed
"""

from __future__ import annotations

from nereus.ir.units import human_bytes  # noqa: F401  (the one byte unit of user-facing text)


def slot_text(layers: int, lo: int, hi: int) -> str:
    """Slot range [lo, hi) in words: embed, layers a..b (inclusive), head."""
    words = []
    if lo == 0:
        words.append("embed")
    a, b = max(lo, 1) - 1, min(hi, layers + 1) - 2
    if a <= b:
        words.append(f"layer {a}" if a == b else f"layers {a}..{b}")
    if hi == layers + 2:
        words.append("head")
    return "+".join(words)


def _xfer_text(dag, x) -> str:
    from nereus.passes.layout import unit_id

    info = dag.stages[x.stage]
    src = unit_id(info.name, dag.frees[x.free].replica)
    dst = unit_id(info.name, dag.allocs[x.alloc].replica)
    where = "tensors" if info.model.is_table else slot_text(info.model.layers, *x.slots)
    return f"{src} -> {dst}  {where}  {len(x.pieces)} pieces"


def program_text(program, summary: dict | None = None) -> str:
    """The listing of a lowered `Program` (module docstring)."""
    from nereus.passes.layout import unit_id

    dag = program.dag
    lines = []
    head = f"transition {dag.source} -> {dag.target}: {program.num_rounds} rounds, " \
           f"{sum(len(m) for m in program.messages)} messages"
    if summary and "bytes" in summary:
        b = summary["bytes"]
        head += f", {human_bytes(b['total'])} moved, {human_bytes(b['intra_node'] + b['inter_node'])} sent" \
                f" (lower bound {human_bytes(summary['lower_bound_bytes'])})"
    lines.append(head)
    if dag.untouched:
        lines.append(f"untouched: {', '.join(dag.untouched)}")
    current = -1
    empty: dict = {}  # (round, kind) -> [index of its folded line, count]

    def fold(k: int, kind: str) -> None:
        if (k, kind) not in empty:
            empty[(k, kind)] = [len(lines), 0]
            lines.append("")
        empty[(k, kind)][1] += 1

    for k, kind, record in program.ops():
        if k != current:
            lines.append(f"round {k}")
            current = k
        if kind == "alloc":
            a = dag.allocs[record]
            if a.bytes == 0:
                fold(k, kind)
                continue
            lines.append(f"  {kind:<9} gpu {a.gpu:<4} {unit_id(dag.stages[a.stage].name, a.replica):<40} "
                         f"{human_bytes(a.bytes)}")
        elif kind in ("free", "stage_out"):
            f = dag.frees[record]
            if f.bytes == 0 and kind == "free":
                fold(k, kind)
                continue
            lines.append(f"  {kind:<9} gpu {f.gpu:<4} {unit_id(dag.stages[f.stage].name, f.replica):<40} "
                         f"{human_bytes(f.bytes)}")
        elif kind == "send":
            lines.append(f"  {'send':<9} {f'{record.src} -> {record.dst}':<8} {len(record.xfers)} transfers"
                         f"{'':<27} {human_bytes(record.bytes)}")
            for x in record.xfers:
                lines.append(f"    {_xfer_text(dag, x)}  {human_bytes(x.bytes)}")
        else:
            lines.append(f"  {kind:<9} gpu {record.dst_gpu:<4} {_xfer_text(dag, record)}  {human_bytes(record.bytes)}")
    for (_, kind), (at, count) in empty.items():
        verb = "allocate" if kind == "alloc" else "free"
        lines[at] = (f"  {kind:<9} {count} unit{'s' if count != 1 else ''} of 0 B (kept in place: nothing to "
                     f"{verb}), not listed")
    return "\n".join(lines) + "\n"


def dag_text(dag) -> str:
    """The TransitionDag's records in their stable order (before any scheduling): per
    model-stage its allocs, transfers (with source choice) and frees."""
    from nereus.passes.layout import unit_id

    lines = [f"dag {dag.source} -> {dag.target}: {len(dag.allocs)} allocs, {len(dag.xfers)} transfers,"
             f" {len(dag.frees)} frees"]
    if dag.untouched:
        lines.append(f"untouched: {', '.join(dag.untouched)}")
    for index, info in enumerate(dag.stages):
        lines.append(f"{info.name}: {_mesh(info.before)} -> {_mesh(info.after)}")
        for a in (a for a in dag.allocs if a.stage == index):
            lines.append(f"  alloc  gpu {a.gpu:<4} {unit_id(info.name, a.replica)} {human_bytes(a.bytes)}")
        for x in (x for x in dag.xfers if x.stage == index):
            where = f"gpu {x.dst_gpu}" if x.src_gpu == x.dst_gpu else f"{x.src_gpu} -> {x.dst_gpu}"
            lines.append(f"  {x.kind:<6} {where:<8} {_xfer_text(dag, x)}  {human_bytes(x.bytes)}")
        for f in (f for f in dag.frees if f.stage == index):
            lines.append(f"  free   gpu {f.gpu:<4} {unit_id(info.name, f.replica)} {human_bytes(f.bytes)}")
    return "\n".join(lines) + "\n"


def _mesh(placement) -> str:
    """dp/tp/pp[/ep], the GPUs and what else the placement sets (a swap of GPUs, a zero or
    offload change is visible in the header)."""
    from nereus.ir.gpuset import format_gpu_set, items_for

    ep = f" ep {placement.ep}" if placement.ep != 1 else ""
    zero = f" zero {placement.zero}" if placement.zero else ""
    offload = " offload" if placement.offload else ""
    return (f"dp {placement.dp} tp {placement.tp} pp {placement.pp}{ep} on "
            f"{format_gpu_set(items_for(placement.gpus))}{zero}{offload}")
