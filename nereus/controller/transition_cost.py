"""Transition cost: the compiler's estimate, with a bytes/bandwidth fallback.

`compiled_seconds` compiles the move with `nereus.passes.compile_transition` and returns its
`CostEstimate.seconds` (per-link, per-round bandwidth model of the lowered program).
`estimated_seconds` is the fallback used when compiling fails or is switched off: every
byte of every model-stage whose placement changes crosses the network once, spread over the
destination GPUs, each GPU's share of its node's port (inter / gpus_per_node), plus a fixed
1 s for process-group and allocator set-up. Pure functions; callers cache.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.models import parameter_count
from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Module, Plan, Workload

FIXED_SECONDS = 1.0
TRAINING_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master, m, v (gradients are transient)


def _pair_module(module: Module, workload: Workload, source: Plan, target: Plan) -> Module:
    plans = (replace(source, name="current", base=None, declared=source.placements),
             replace(target, name="candidate", base=None, declared=target.placements))
    return replace(module, workload=workload, plans=plans, transitions=())


def compiled_seconds(module: Module, workload: Workload, source: Plan, target: Plan) -> float:
    """The transition compiler's predicted seconds for source → target (raises NereusError)."""
    from nereus.passes import compile_transition

    # check_fit off: the running plan may have stopped fitting the drifted workload (which
    # is why the controller looks elsewhere), and candidates are checked by the search
    compiled = compile_transition(_pair_module(module, workload, source, target), "current", "candidate",
                                  check_fit=False)
    return float(compiled.cost.seconds)


def estimated_seconds(module: Module, workload: Workload, source: Plan, target: Plan) -> float:
    """Bytes of the changed model-stages over the destination GPUs' network share, + 1 s."""
    cluster = module.cluster
    moved = 0.0
    gpus: set[int] = set()
    for placement in target.placements:
        try:
            before = source.placement(placement.model_stage)
        except KeyError:
            before = None
        if before is not None and (before.dp, before.tp, before.pp, before.gpus) == \
                (placement.dp, placement.tp, placement.pp, placement.gpus):
            continue
        model = module.model(placement.model_stage.model)
        per_param = TRAINING_BYTES_PER_PARAM if placement.model_stage.stage == "training" else model.dtype_bytes
        moved += parameter_count(model) * per_param
        gpus.update(placement.gpus)
    if not moved:
        return 0.0
    per_gpu_bandwidth = cluster.inter_bytes_per_s / cluster.gpus_per_node
    return FIXED_SECONDS + moved / max(1, len(gpus)) / per_gpu_bandwidth


def transition_seconds(module: Module, workload: Workload, source: Plan, target: Plan,
                       method: str = "compile") -> tuple[float, str]:
    """(seconds, how): the compiler's estimate when method is "compile" and it compiles,
    else the fallback estimate."""
    if method == "compile":
        try:
            return compiled_seconds(module, workload, source, target), "compiled"
        except (NereusError, ValueError, KeyError, AssertionError) as error:  # noqa: F841 - fall back
            return estimated_seconds(module, workload, source, target), f"estimated ({type(error).__name__})"
    return estimated_seconds(module, workload, source, target), "estimated"
