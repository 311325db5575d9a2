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
            from .infeasible import require_fit

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
            "bounds": _bounds_json(program, cost),
            "peak_memory": _peak_json(cost.peak, state.module, compiled.source, compiled.target),
            "resource_edges": _edge_counts(sched),
            "chunked": sched.chunked,
            "notes": list(sched.notes),
        })
    if compiled.timings:
        out["timings"] = dict(compiled.timings)
    return out


# The share of a GPU's memory a transition's peak must leave free: the CUDA context (a few
# hundred MiB on H100/H200), NCCL's channel buffers and the caching allocator's rounding and
# fragmentation take it, and the compiler counts none of them. The resources pass fills the
# usable memory, mem x (1 - reserve), with transfer buffers by design (fewer, larger chunks),
# so a peak at 100% of it is normal, and the cluster's `reserve` is what keeps this share
# free: with reserve >= FREE_MARGIN no transition warns (the verifier proves the peak within
# the usable memory). 5%: the bundled examples' reserve, the room their comments give the
# CUDA context and allocator slack.
FREE_MARGIN = 0.05


def _peak_json(peak, module, source: str, target: str) -> dict:
    """The peak of the worst GPU, what it leaves of the GPU's whole memory, and a warning with
    a hint when that is below FREE_MARGIN (`peak_warning`)."""
    from dataclasses import replace

    cluster = module.cluster
    limit = replace(cluster, reserve=FREE_MARGIN).usable_gpu_bytes  # the same rounding as usable memory
    warning = peak.bytes > limit
    return {"gpu": peak.gpu, "round": peak.round, "bytes": peak.bytes, "capacity_bytes": peak.capacity_bytes,
            "headroom_bytes": peak.headroom_bytes, "fraction": peak.fraction, "gpu_bytes": cluster.gpu.mem_bytes,
            "free_bytes": cluster.gpu.mem_bytes - peak.bytes, "free_margin": FREE_MARGIN, "warning": warning,
            "hint": peak_hint(module, source, target) if warning else None, "memory_model": peak.memory_model}


def peak_hint(module, source: str, target: str) -> str:
    """What makes the peak warning go away: the `reserve` that keeps FREE_MARGIN free, when
    both plans fit with it (then the scheduler keeps the peak within it); else what the plans
    need first."""
    from dataclasses import replace

    from nereus.ir.units import format_fraction, human_bytes

    from .feasibility import check_plan

    cluster = module.cluster
    wanted = format_fraction(FREE_MARGIN)
    if cluster.reserve >= FREE_MARGIN:  # only a pipeline without `resources` overflows usable memory
        return "keep the `resources` pass in --pipeline: it schedules the transition within the usable memory"
    roomy = replace(module, cluster=replace(cluster, reserve=FREE_MARGIN))
    for name in (source, target):
        report = check_plan(roomy, name)
        if not report.feasible:
            worst = report.worst
            return (f"`reserve {wanted}` in cluster {cluster.name} would keep it free, but plan {name} does not fit "
                    f"with it (GPU {worst.gpu} needs {human_bytes(worst.bytes)} in {worst.stage}, "
                    f"{human_bytes(report.capacity_bytes)} usable): `nereusc check {_file(module)} --set "
                    f"cluster.reserve={wanted}` names placements of it that fit")
    return (f"set `reserve {wanted}` in cluster {cluster.name} (now {format_fraction(cluster.reserve)}): the "
            f"scheduler then keeps "
            f"{human_bytes(cluster.gpu.mem_bytes - roomy.cluster.usable_gpu_bytes)} of every GPU free, "
            f"and both plans fit with it")


def _file(module) -> str:
    return module.file if module.file and not module.file.startswith("<") else "FILE"


def _bounds_json(program, cost) -> dict:
    """The link bounds (`cost.link_bounds`): the busiest node's NIC and the average NIC."""
    from .cost import link_bounds

    b = link_bounds(program, cost)
    return {"busiest_nic_seconds": b.busiest_nic_seconds, "busiest_node": b.busiest_node,
            "average_nic_seconds": b.aggregate_seconds}


def _edge_counts(schedule) -> dict:
    counts: dict = {}
    for e in schedule.edges:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    return counts
