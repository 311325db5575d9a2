"""JSON program v1: the contract between compiler and runtime (docs/program.md).

    program_json(compiled) -> dict              # a CompiledTransition → v1 dict
    program_to_json(program) -> dict            # a lowered Program (or a JsonProgram) → v1 dict
    program_from_json(data) -> JsonProgram      # checked wrapper of a v1 dict
    plan_units_json(module, plan, model_stage=None) -> [UNIT, ...]
    rank_program(data, rank) -> [[OP, ...] per round]   # what one rank executes

Emission expands symbolic ops: an op covering a layer range becomes one segment per layer,
tensor and optimizer state, in a fixed order (slot, then piece, then state), so two
compilations of the same input give byte-identical JSON. Imports neither torch nor triton.
"""

from __future__ import annotations

import gc
from typing import Iterator, Optional

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Module

# the reader lives with the IR; re-exported here beside the emitter for old callers
from nereus.ir.program import FORMAT, VERSION, JsonProgram, program_from_json  # noqa: F401
# units are derived from the plans where the verifier derives them too
from nereus.passes.world import box_json, placement_units, unit_json  # noqa: F401


def plan_units_json(module: Module, plan_name: str, model_stage: Optional[str] = None) -> list[dict]:
    """UNIT dicts of a plan's layout (all model-stages, or one): how the runtime lays out
    state before any transition. Same shape as the program's `units` entries."""
    plan = module.plan(plan_name)
    out = []
    for placement in plan.placements:
        if model_stage is None or str(placement.model_stage) == model_stage:
            out.extend(placement_units(module.model(placement.model_stage.model), placement))
    return out


def _tensors(dag) -> list[dict]:
    from nereus.passes.layout import tensor_entries

    seen: dict[str, dict] = {}
    for info in dag.stages:
        for name, shape, dtype in tensor_entries(info.model, info.states):
            if name not in seen:
                seen[name] = {"name": name, "shape": list(shape), "dtype": dtype}
    return list(seen.values())


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


def program_json(compiled) -> dict:
    """The v1 dict of a CompiledTransition (nereus.passes.compile_transition)."""
    if compiled.program is None:
        raise SemanticError("the pipeline stopped before 'lower': no program to emit",
                            hint="use the default pipeline (nereus.passes.DEFAULT_PIPELINE)")
    return program_to_json(compiled.program)


def program_to_json(program) -> dict:
    """The v1 dict of a lowered `Program` (nereus.passes.lower) or a `JsonProgram`."""
    if isinstance(program, JsonProgram):
        return program.data
    # millions of small lists, none cyclic: the cycle collector would only rescan them
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _emit(program)
    finally:
        if enabled:
            gc.enable()


def op_json(dag, kind: str, record) -> dict:
    """The v1 dict of one op of `Program.ops()` (without its `id` and `round`)."""
    from nereus.passes.layout import unit_id

    if kind == "alloc":
        a = dag.allocs[record]
        return {"op": "alloc", "gpu": a.gpu, "unit": unit_id(dag.stages[a.stage].name, a.replica), "bytes": a.bytes}
    if kind in ("free", "stage_out"):
        f = dag.frees[record]
        return {"op": kind, "gpu": f.gpu, "unit": unit_id(dag.stages[f.stage].name, f.replica), "bytes": f.bytes}
    if kind == "send":
        segments = [s for x in record.xfers for s in _segments(dag, x)]
        return {"op": "send", "src": record.src, "dst": record.dst, "segments": segments, "bytes": record.bytes}
    op = {"op": kind, "gpu": record.dst_gpu, "segments": list(_segments(dag, record))}
    if kind == "copy":
        op["bytes"] = record.bytes
    return op


def _emit(program) -> dict:
    dag = program.dag
    module = dag.module
    cluster = module.cluster
    gpus = [{"id": g, "node": cluster.node_of(g), "mem_bytes": cluster.gpu.mem_bytes,
             "capacity_bytes": cluster.usable_gpu_bytes} for g in range(cluster.num_gpus)]
    units = {"before": [], "after": []}
    for info in dag.stages:
        units["before"].extend(placement_units(info.model, info.before))
        units["after"].extend(placement_units(info.model, info.after))
    rounds = []
    next_id = 0
    for k, kind, record in program.ops():
        while len(rounds) <= k:
            rounds.append({"ops": []})
        op = op_json(dag, kind, record)
        op["id"] = next_id
        op["round"] = k
        next_id += 1
        rounds[k]["ops"].append(op)
    while len(rounds) < program.num_rounds:
        rounds.append({"ops": []})
    return {
        "format": FORMAT, "version": VERSION,
        "transition": {"from": dag.source, "to": dag.target},
        "gpus": gpus,
        "nodes": [{"id": n, "host_mem_bytes": cluster.host_mem_bytes} for n in range(cluster.nodes)],
        "tensors": _tensors(dag),
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
