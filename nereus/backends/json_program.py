"""JSON program v1 and v2: the contract between compiler and runtime (docs/program.md).

    program_json(compiled, version=2) -> dict   # a CompiledTransition → v2 (or v1) dict
    program_to_json(program, version=2) -> dict # a lowered Program (or a JsonProgram) → dict
    program_from_json(data) -> JsonProgram      # checked wrapper of a v1 or v2 dict
    plan_units_json(module, plan, model_stage=None) -> [UNIT, ...]
    rank_program(data, rank) -> [[OP, ...] per round]   # what one rank executes

Emission expands symbolic ops in a fixed order, so two compilations of the same input give
byte-identical JSON. v1: an op covering a layer range becomes one segment per layer,
tensor and optimizer state (slot, then piece, then state). v2 (the default): one segment
per tensor family, box and run of experts, with the layer range and the expert run as
`at` ranges (`_ranged_segments`): a transfer's segments no longer grow with its layers or
experts. Imports neither torch nor triton.
"""

from __future__ import annotations

import gc
from typing import Iterator, Optional

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Module

# the reader lives with the IR; re-exported here beside the emitter for old callers
from nereus.ir.program import FORMAT, VERSION, JsonProgram, compact_segment_units, program_from_json  # noqa: F401
from nereus.ir.ranges import at_json, runs
# units are derived from the plans where the verifier derives them too
from nereus.passes.world import box_json, placement_units, tensors_json, unit_json  # noqa: F401


def plan_units_json(module: Module, plan_name: str, model_stage: Optional[str] = None) -> list[dict]:
    """UNIT dicts of a plan's layout (all model-stages, or one): how the runtime lays out
    state before any transition. Same shape as the program's `units` entries."""
    plan = module.plan(plan_name)
    out = []
    for placement in plan.placements:
        if model_stage is None or str(placement.model_stage) == model_stage:
            out.extend(placement_units(module.model(placement.model_stage.model), placement))
    return out


def _tensors(dag, ranged: bool) -> list[dict]:
    seen: dict[str, dict] = {}
    for info in dag.stages:
        for entry in tensors_json(info.model, info.states, ranged):
            seen.setdefault(entry["name"], entry)
    return list(seen.values())


def _ranged_segments(dag, x) -> Iterator[dict]:
    """A transfer's segments as JSON program v2 writes them: per slot kind (embed slot,
    layers, last slot), per (family, box) in piece order, per run of experts, per state:
    one segment whose `at` holds the transfer's layer range (and the expert run)."""
    from nereus.passes.layout import unit_id

    info = dag.stages[x.stage]
    model = info.model
    src = unit_id(info.name, dag.frees[x.free].replica)
    dst = unit_id(info.name, dag.allocs[x.alloc].replica)
    lo, hi = x.slots
    last = model.layers + 1
    layers = (max(lo, 1) - 1, min(hi, last) - 1)
    for kind, present in (("first", lo <= 0 < hi), ("layer", layers[0] < layers[1]), ("last", lo <= last < hi)):
        if not present:
            continue
        for fam, box, experts in _piece_groups(model, x.pieces, kind):
            if kind != "layer":
                ats = [None]
            elif experts is None:
                ats = [[[layers[0], layers[1]]]]
            else:
                ats = [[[layers[0], layers[1]]] + at_json((r,)) for r in experts]
            for at in ats:
                for suffix in x.states:
                    seg = {"tensor": fam + suffix}
                    if at is not None:
                        seg["at"] = at
                    seg.update(box=box, src_unit=src, dst_unit=dst)
                    yield seg


_GROUPS: dict = {}  # (model, pieces, kind) -> groups; pieces tuples recur across transfers


def _piece_groups(model, pieces, kind: str) -> tuple:
    """((family, box as JSON, expert runs or None), ...) of the pieces of slot kind `kind`,
    grouped by (family, box) in first-piece order; a group of experts lists their runs."""
    key = (model, pieces, kind)
    found = _GROUPS.get(key)
    if found is not None:
        return found
    from nereus.passes.layout import slot_specs, spec_family

    specs = slot_specs(model)
    groups: dict = {}
    for piece in pieces:
        spec = specs[piece.spec]
        if spec.kind != kind:
            continue
        fam, expert = spec_family(spec, model.name)
        groups.setdefault((fam, piece.box), []).append(expert)
    out = tuple((fam, box_json(box), None if experts[0] is None else tuple(runs(sorted(experts))))
                for (fam, box), experts in groups.items())
    if len(_GROUPS) > 4096:
        _GROUPS.clear()
    _GROUPS[key] = out
    return out


def _segments(dag, x) -> Iterator[dict]:
    from nereus.passes.layout import slot_kind, slot_specs, unit_id

    info = dag.stages[x.stage]
    model = info.model
    specs = slot_specs(model)
    src = unit_id(info.name, dag.frees[x.free].replica)
    dst = unit_id(info.name, dag.allocs[x.alloc].replica)
    for slot in range(*x.slots):
        kind = slot_kind(model, slot)
        for piece in x.pieces:
            spec = specs[piece.spec]
            if spec.kind != kind:
                continue
            name = spec.name(model.name, slot)
            box = box_json(piece.box)
            for suffix in x.states:
                yield {"tensor": name + suffix, "box": box, "src_unit": src, "dst_unit": dst}


def program_json(compiled, version: int = VERSION) -> dict:
    """The v2 (or `version` 1) dict of a CompiledTransition (nereus.passes.compile_transition)."""
    if compiled.program is None:
        raise SemanticError("the pipeline stopped before 'lower': no program to emit",
                            hint="use the default pipeline (nereus.passes.DEFAULT_PIPELINE)")
    return program_to_json(compiled.program, version)


def check_version(version) -> int:
    if version not in (1, 2):
        raise SemanticError(f"no JSON program version {version!r}", hint="versions 1 and 2 (docs/program.md)")
    return version


def program_to_json(program, version: int = VERSION) -> dict:
    """The v2 (or `version` 1) dict of a lowered `Program` (nereus.passes.lower), or the
    dict of a `JsonProgram` as it is."""
    if isinstance(program, JsonProgram):
        return program.data
    check_version(version)
    # millions of small lists, none cyclic: the cycle collector would only rescan them
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _emit(program, version == 2)
    finally:
        if enabled:
            gc.enable()


def op_json(dag, kind: str, record, ranged: bool = False) -> dict:
    """The dict of one op of `Program.ops()` (without its `id` and `round`); `ranged`:
    v2 segments (`_ranged_segments`), else v1's one per member."""
    from nereus.passes.layout import unit_id

    if kind == "alloc":
        a = dag.allocs[record]
        return {"op": "alloc", "gpu": a.gpu, "unit": unit_id(dag.stages[a.stage].name, a.replica), "bytes": a.bytes}
    if kind in ("free", "stage_out"):
        f = dag.frees[record]
        return {"op": kind, "gpu": f.gpu, "unit": unit_id(dag.stages[f.stage].name, f.replica), "bytes": f.bytes}
    segments_of = _ranged_segments if ranged else _segments
    if kind == "send":
        segments = [s for x in record.xfers for s in segments_of(dag, x)]
        return {"op": "send", "src": record.src, "dst": record.dst, "segments": segments, "bytes": record.bytes}
    op = {"op": kind, "gpu": record.dst_gpu, "segments": list(segments_of(dag, record))}
    if kind == "copy":
        op["bytes"] = record.bytes
    return op


def _emit(program, ranged: bool) -> dict:
    dag = program.dag
    module = dag.module
    cluster = module.cluster
    gpus = [{"id": g, "node": cluster.node_of(g), "mem_bytes": cluster.gpu.mem_bytes,
             "capacity_bytes": cluster.usable_gpu_bytes} for g in range(cluster.num_gpus)]
    units = {"before": [], "after": []}
    for info in dag.stages:
        units["before"].extend(placement_units(info.model, info.before, ranged))
        units["after"].extend(placement_units(info.model, info.after, ranged))
    rounds = []
    next_id = 0
    for k, kind, record in program.ops():
        while len(rounds) <= k:
            rounds.append({"ops": []})
        op = op_json(dag, kind, record, ranged)
        if ranged:  # v2 states a pair of units shared by every segment once, on the op
            op = compact_segment_units(op)
        op["id"] = next_id
        op["round"] = k
        next_id += 1
        rounds[k]["ops"].append(op)
    while len(rounds) < program.num_rounds:
        rounds.append({"ops": []})
    return {
        "format": FORMAT, "version": 2 if ranged else 1,
        "transition": {"from": dag.source, "to": dag.target},
        "gpus": gpus,
        "nodes": [{"id": n, "host_mem_bytes": cluster.host_mem_bytes} for n in range(cluster.nodes)],
        "tensors": _tensors(dag, ranged),
        "units": units,
        "resident_bytes": {str(g): b for g, b in enumerate(dag.resident)},
        "untouched": list(dag.untouched),
        "memory_model": program.schedule.memory_model,
        "rounds": rounds,
    }


def rank_program(data: dict, rank: int) -> list[list[dict]]:
    """Per round, the ops of `rank` in program order; a send becomes `send` on its source
    and `recv` (same fields) on its destination."""
    out = []
    for rnd in data["rounds"]:
        ops = []
        for op in rnd["ops"]:
            if op["op"] == "send":
                if op["src"] == rank:
                    ops.append(op)
                if op["dst"] == rank:
                    ops.append(dict(op, op="recv"))
            elif op.get("gpu") == rank:
                ops.append(op)
        out.append(ops)
    return out
