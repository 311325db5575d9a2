"""Memory of candidate layouts, computed with the feasibility pass's own per-unit helpers.

The search and `nereusc check` must agree on what fits, so the bytes come from
`nereus.passes.feasibility.model_state_bytes_per_gpu` / `working_bytes_per_gpu`, and the
per-(GPU, stage) rule is the pass's: resident state of every unit on the GPU (an offloaded
unit only in its own stage) plus the largest working set among the units active there.

One extension, for generation: the pass sizes the KV cache for every sequence of a replica
at once. A serving engine (vLLM) instead runs the sequences in waves when they do not all
fit, so with `allow_waves` a generation unit whose full KV cache does not fit is still
feasible, in w = ⌈B_r / B_fit⌉ waves where B_fit is the largest per-replica batch whose
cache fits beside everything resident; the cost model charges the waves. With
`allow_waves=False` the result equals the feasibility pass exactly (tests check both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from nereus.models import pp_layer_range
from nereus.ir.model import STAGES, ModelStage, Module, Plan, Workload
from nereus.passes.feasibility import model_state_bytes_per_gpu, working_bytes_per_gpu


@dataclass(frozen=True)
class UnitMemory:
    """Bytes of one model-stage's unit per pipeline stage on each of its GPUs.

    resident[p]: state held at every stage (weights; training also grads and optimizer).
    working[p]: bytes during its own stage; for generation, per sequence of the replica."""

    model_stage: ModelStage
    tp: int
    pp: int
    offload: bool
    resident: tuple[int, ...]
    working: tuple[int, ...]

    def vectors(self, period: int) -> tuple[np.ndarray, np.ndarray]:
        """(resident, working) over GPU positions 0..period-1 of a placement on consecutive
        GPUs: position q is pipeline stage (q mod tp·pp) // tp (mesh order of docs/ir.md)."""
        index = (np.arange(period) % (self.tp * self.pp)) // self.tp
        return np.asarray(self.resident, dtype=float)[index], np.asarray(self.working, dtype=float)[index]


def light(module: Module) -> Module:
    """The module without plans and transitions: what the memory formulas read, cheap to hash."""
    return module if not module.plans and not module.transitions else replace(module, plans=(), transitions=())


def unit_memory(module: Module, workload: Workload, model_stage: ModelStage, dp: int, tp: int, pp: int,
                offload: bool) -> UnitMemory:
    """Per-pipeline-stage bytes of a (dp, tp, pp) unit of `model_stage` under `workload`."""
    return _unit_memory(light(module), workload, model_stage, dp, tp, pp, offload)


@lru_cache(maxsize=16384)
def _unit_memory(module: Module, workload: Workload, model_stage: ModelStage, dp: int, tp: int, pp: int,
                 offload: bool) -> UnitMemory:
    model = module.model(model_stage.model)
    stage = model_stage.stage
    if stage == "generation":
        # one sequence per replica: the KV cache and logits scale linearly with sequences
        sized = replace(module, workload=replace(workload, batch=dp))
    else:
        sized = module if module.workload == workload else replace(module, workload=workload)
    resident, working = [], []
    seen: dict = {}
    for p in range(pp):
        # stages with the same layer count and no edge tensors hold the same bytes, except
        # that training keeps (pp − p) microbatches in flight on stage p
        lo, hi = pp_layer_range(model.layers, pp, p)
        shape = (hi - lo, p == 0, p == pp - 1, pp - p if stage == "training" else 0)
        if shape not in seen:
            seen[shape] = (sum(model_state_bytes_per_gpu(model, stage, tp, pp, p).values()),
                           sum(working_bytes_per_gpu(sized, model, stage, dp, tp, pp, p).values()))
        resident.append(seen[shape][0])
        working.append(seen[shape][1])
    return UnitMemory(model_stage, tp, pp, offload, tuple(resident), tuple(working))


def active_stages(workload: Workload) -> tuple[str, ...]:
    return tuple(s for s in STAGES if workload.models_in(s))


def waves_for(free: np.ndarray, per_sequence: np.ndarray, replica_batch: int, allow_waves: bool) -> int:
    """Waves a generation unit needs: 1 if all `replica_batch` sequences fit in `free` bytes on
    every GPU, else ⌈replica_batch / fit⌉ (allow_waves), else 0 meaning infeasible."""
    need = per_sequence > 0
    if not need.any():
        return 1 if (free >= 0).all() else 0
    if (free < 0).any():
        return 0
    fit = int(np.floor(np.min(free[need] / per_sequence[need])))
    if fit >= replica_batch:
        return 1
    if not allow_waves or fit < 1:
        return 0
    return math.ceil(replica_batch / fit)


@dataclass(frozen=True)
class PlanMemory:
    feasible: bool
    waves: dict  # ModelStage -> waves (generation units)
    worst_gpu: int
    worst_stage: str
    worst_bytes: int
    capacity_bytes: int


def _period(plan: Plan):
    """Q = lcm(tp·pp) when every placement covers the same GPUs 0..G−1 in order (then GPU g
    holds what GPU g mod Q holds, and Q columns give the same answer as G); else None."""
    size = len(plan.placements[0].gpus) if plan.placements else 0
    ordered = tuple(range(size))
    if any(p.gpus != ordered for p in plan.placements):
        return None
    period = math.lcm(*(p.tp * p.pp for p in plan.placements)) if plan.placements else 0
    return period if period and size % period == 0 else None


def plan_memory(module: Module, workload: Workload, plan: Plan, allow_waves: bool = True) -> PlanMemory:
    """Per-(GPU, stage) memory of an arbitrary plan under `workload`, with generation waves.

    Output: PlanMemory; with allow_waves=False `feasible` equals the feasibility pass's."""
    stages = active_stages(workload)
    module = light(module)
    period = _period(plan)
    gpus = period or module.cluster.num_gpus
    capacity = module.cluster.usable_gpu_bytes
    resident = np.zeros((len(stages), gpus))
    working = np.zeros((len(stages), gpus))
    generation = []
    for placement in plan.placements:
        ms = placement.model_stage
        if ms.stage not in stages:
            continue
        unit = unit_memory(module, workload, ms, placement.dp, placement.tp, placement.pp, placement.offload)
        index = np.arange(period) if period else np.array(placement.gpus)
        res, work = unit.vectors(period or placement.world)
        own = stages.index(ms.stage)
        for x in range(len(stages)):
            if not placement.offload or x == own:
                resident[x, index] += res  # a placement names each GPU once
        if ms.stage == "generation":
            generation.append((placement, index, work))
        else:
            working[own, index] = np.maximum(working[own, index], work)
    waves = {}
    feasible = True
    for placement, index, per_sequence in generation:
        x = stages.index("generation")
        replica_batch = math.ceil(workload.batch / placement.dp)
        free = capacity - resident[x, index]
        w = waves_for(free, per_sequence, replica_batch, allow_waves)
        waves[placement.model_stage] = max(w, 1)
        if w == 0:
            feasible = False
            w = 1
        wave_batch = math.ceil(replica_batch / w)
        working[x, index] = np.maximum(working[x, index], per_sequence * wave_batch)
    usage = resident + working
    flat = int(np.argmax(usage))
    stage_i, gpu = divmod(flat, gpus)
    worst = int(usage[stage_i, gpu])
    return PlanMemory(feasible and worst <= capacity, waves, gpu, stages[stage_i], worst, capacity)
