"""Transition passes: plan S → plan S* compiled into a memory-safe rank program.

    from nereus.passes import compile_transition
    compiled = compile_transition(module, "S1", "S2")      # default pipeline
    program_json(compiled)  # JSON program v1 (nereus.backends.json_program, docs/program.md)
    compiled.summary        # per model-stage primitives, op counts, rounds, bytes, lower bound
    compiled.timings        # seconds per pass
    compiled.cost           # CostEstimate (predicted seconds, bytes by link class)

One module per pass (diff, dag, resources, fusion, lower, cost; layout holds the box
arithmetic, verify the program checker); `manager` runs a named pipeline. Deterministic:
the runtime compiles on every rank and relies on identical output. Imports neither torch
nor triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Module

from .manager import DEFAULT_PIPELINE, CompileState, PassManager, parse_pipeline, paused_gc
from .memory_model import DEFAULT as DEFAULT_MEMORY_MODEL, check_kind


@dataclass(frozen=True)
class CompiledTransition:
    source: str
    target: str
    state: CompileState = field(repr=False)
    timings: dict = field(default_factory=dict)

    @property
    def program(self):
        return self.state.program

    @property
    def dag(self):
        return self.state.dag

    @property
    def cost(self):
        if self.state.cost is None and self.state.program is not None:
            from .cost import estimate

            return estimate(self.state.program)
        return self.state.cost

    @property
    def summary(self) -> dict:
        return summarize(self)


def compile_transition(module: Module, source: str, target: str, *, pipeline: Optional[str] = None,
                       print_after_all=None, check_fit: bool = True, memory_model: str = DEFAULT_MEMORY_MODEL,
                       **options) -> CompiledTransition:
    """Compile the move from plan `source` to plan `target` of `module`.

    Both plans must fit (`nereusc check`'s memory model): otherwise an InfeasibleError
    with the check's wording is raised before any pass runs, in the time the check takes,
    instead of after the scheduler has searched for a memory-safe order that cannot exist.
    `check_fit=False` skips that (tests of the scheduler on deliberately full GPUs).
    `memory_model`: the device memory model the rounds are made safe under and the
    program records ("cuda", the default: what a send costs on GPUs; "cpu": v1's original
    model, exact only for the gloo runtime; nereus.passes.memory_model).
    `options` set pass options by name (`bucket=256 << 20`, `independent=True`,
    `staging=False`) on the passes of the pipeline that have them."""
    try:
        check_kind(memory_model)
    except ValueError as error:
        raise SemanticError(str(error), hint="compile for 'cuda' (GPUs) unless the program runs on gloo CPUs") from None
    names = {p.name for p in module.plans}
    for plan in (source, target):
        if plan not in names:
            raise SemanticError(f"no plan named {plan!r}", hint=f"plans: {', '.join(sorted(names))}")
    text = pipeline or DEFAULT_PIPELINE
    if options:
        text = _with_options(text, options)
    manager = PassManager(text, print_after_all=print_after_all)
    with paused_gc():
        if check_fit:
            from .feasibility import require_fit

            require_fit(module, source, target)
        state = manager.run(CompileState(module, source, target, memory_model=memory_model))
    return CompiledTransition(source, target, state, dict(manager.timings))


def _with_options(text: str, options: dict) -> str:
    from dataclasses import fields

    from .manager import PASSES, PipelineError

    passes = parse_pipeline(text)
    used = set()
    parts = []
    for p in passes:
        own = {f.name: getattr(p, f.name) for f in fields(p)}
        for key, value in options.items():
            if key in own:
                own[key] = value
                used.add(key)
        body = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in own.items() if v is not None)
        parts.append(p.name + (f"{{{body}}}" if body else ""))
    unknown = set(options) - used
    if unknown:
        raise PipelineError(f"no pass of the pipeline takes option(s) {sorted(unknown)}",
                            hint=", ".join(f"{n}: {[f.name for f in fields(c)]}" for n, c in PASSES.items()))
    return ",".join(parts)


def summarize(compiled: CompiledTransition) -> dict:
    """Per model-stage primitives and op counts; rounds; bytes by class; lower bound; edges;
    the peak memory of the worst GPU during the transition (`cost.memory_peak`)."""
    state = compiled.state
    out: dict = {"transition": f"{compiled.source} -> {compiled.target}", "stages": {}}
    if state.diff is not None:
        for sd in state.diff.stages:
            out["stages"][sd.model_stage] = {
                "unchanged": sd.unchanged,
                "kept_units": len(sd.kept),
                "primitives": [str(p) for p in sd.primitives],
            }
    program = state.program
    if program is not None:
        dag = program.dag
        counts: dict = {}
        for _, kind, record in program.ops():
            if kind == "send":
                stage_ids = {x.stage for x in record.xfers}
            elif kind == "alloc":
                stage_ids = {dag.allocs[record].stage}
            elif kind in ("free", "stage_out"):
                stage_ids = {dag.frees[record].stage}
            else:
                stage_ids = {record.stage}
            for s in stage_ids:
                entry = counts.setdefault(dag.stages[s].name, {})
                entry[kind] = entry.get(kind, 0) + 1
        for name, entry in counts.items():
            out["stages"][name]["ops"] = entry
        cost = compiled.cost
        sched = program.schedule
        out.update({
            "rounds": program.num_rounds,
            "messages": sum(len(m) for m in program.messages),
            "bytes": {"total": cost.bytes_total, "local": cost.bytes_local, "intra_node": cost.bytes_intra,
                      "inter_node": cost.bytes_inter, "staged": cost.bytes_staged, "kept": cost.bytes_kept},
            "lower_bound_bytes": cost.lower_bound,
            "predicted_seconds": cost.seconds,
            "peak_memory": _peak_json(cost.peak),
            "resource_edges": _edge_counts(sched),
            "chunked": sched.chunked,
            "notes": list(sched.notes),
        })
    if compiled.timings:
        out["timings"] = dict(compiled.timings)
    return out


PEAK_WARNING_FRACTION = 0.95  # above this the summary warns: a transition on the edge of its GPUs


def _peak_json(peak) -> dict:
    return {"gpu": peak.gpu, "round": peak.round, "bytes": peak.bytes, "capacity_bytes": peak.capacity_bytes,
            "headroom_bytes": peak.headroom_bytes, "fraction": peak.fraction,
            "warning": peak.fraction > PEAK_WARNING_FRACTION, "memory_model": peak.memory_model}


def _edge_counts(schedule) -> dict:
    counts: dict = {}
    for e in schedule.edges:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    return counts
