"""Memory of candidate layouts, computed with the feasibility pass's own per-GPU rule.

The search and `nereusc check` must agree on what fits, so the bytes come from
`nereus.passes.feasibility.unit_resident_bytes` and `unit_working_bytes` (weights, grads and
optimizer state with their ZeRO chunks, expert shards per EP rank, KV cache, activations,
logits, all-to-all buffers, ZeRO-3's gathered layers), the per-(GPU, stage) rule is the pass's (resident state of every
unit on the GPU, an offloaded unit only in its own stage, plus the largest working set among
the units active there), and host memory is the pass's own count
(`feasibility.offloaded_host_bytes`). tests/controller/test_memory_agrees.py checks that
`plan_memory(..., allow_waves=False)` gives the pass's worst bytes and verdict for random
plans over every key (dp, tp, pp, ep, zero, offload, recompute, GPU sets, reserve, host memory).

One extension, for generation: the pass sizes the KV cache for every sequence of a replica
at once. A serving engine (vLLM) instead runs the sequences in waves when they do not all
fit, so with `allow_waves` a generation unit whose full KV cache does not fit is still
feasible, in w = ⌈B_g / B_fit⌉ waves where B_g is the sequences a GPU decodes (⌈batch /
(dp·ep)⌉) and B_fit the most whose cache fits beside everything resident; the cost model
charges the waves. With `allow_waves=False` the result equals the feasibility pass exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from nereus.models import pp_layer_range
from nereus.ir.model import STAGES, ModelStage, Module, Plan, Workload
from nereus.passes.feasibility import host_held_bytes, offloaded_host_bytes, unit_resident_bytes, unit_working_bytes


@dataclass(frozen=True)
class UnitMemory:
    """Bytes of one model-stage's unit on each of its GPUs.

    resident[r][p]: state held at every stage (weights; training also grads and optimizer)
    on pipeline stage p of replica r; one row for every replica unless the unit shards its
    training state with ZeRO and was asked for every replica (then replica r's chunk;
    replica 0 holds the most, and a single row is replica 0's).
    host[r][p]: of that, what waits in host memory when the unit is offloaded.
    working[p]: bytes during its own stage; for generation, per sequence the GPU decodes."""

    model_stage: ModelStage
    dp: int
    tp: int
    pp: int
    offload: bool
    resident: tuple[tuple[int, ...], ...]
    working: tuple[int, ...]
    ep: int = 1
    host: tuple[tuple[int, ...], ...] = ()

    @property
    def mesh(self) -> int:
        """GPUs of one replica: tp·ep·pp."""
        return self.tp * self.ep * self.pp

    def vectors(self, period: int) -> tuple[np.ndarray, np.ndarray]:
        """(resident, working) over GPU positions 0..period-1 of a placement on consecutive
        GPUs: position q is pipeline stage (q mod tp·ep·pp) // (tp·ep) of replica q // (tp·ep·pp)
        (mesh order of docs/ir.md). Per-replica rows need a period that the whole unit divides."""
        return self._over(self.resident, period), self._over((self.working,), period)

    def host_vector(self, period: int) -> np.ndarray:
        """Host-memory bytes of an offloaded unit over GPU positions 0..period-1 (as `vectors`)."""
        return self._over(self.host, period)

    def _over(self, rows, period: int) -> np.ndarray:
        q = np.arange(period)
        stage = (q % self.mesh) // (self.tp * self.ep)
        table = np.asarray(rows, dtype=float)
        if len(rows) == 1:
            return table[0][stage]
        if period % (self.mesh * self.dp):
            raise ValueError(f"a period of {period} GPUs splits the replicas of a ZeRO unit of "
                             f"{self.mesh * self.dp} GPUs")
        return table[(q // self.mesh) % self.dp, stage]


def light(module: Module) -> Module:
    """The module without plans and transitions: what the memory formulas read, cheap to hash."""
    return module if not module.plans and not module.transitions else replace(module, plans=(), transitions=())


def unit_memory(module: Module, workload: Workload, model_stage: ModelStage, dp: int, tp: int, pp: int,
                offload: bool, zero: int = 0, ep: int = 1, every_replica: bool = True) -> UnitMemory:
    """Per-GPU bytes of a (dp, tp, pp, ep, zero) unit of `model_stage` under `workload`.
    `every_replica=False`: under ZeRO, replica 0's chunk (the largest) stands for every
    replica: an upper bound within a row per tensor, without a row per replica."""
    zero = zero if model_stage.stage == "training" else 0
    module = light(module)
    resident, host = _resident_rows(module, model_stage, dp, tp, pp, zero, ep, every_replica and zero > 0)
    working = _working_row(module, workload, model_stage, dp, tp, pp, zero, ep)
    return UnitMemory(model_stage, dp, tp, pp, offload, resident, working, ep, host)


def _stage_shapes(model, stage: str, pp: int) -> list[tuple]:
    """A key per pipeline stage: stages with the same layer count and no edge tensors hold the
    same bytes, except that training keeps (pp − p) microbatches in flight on stage p."""
    shapes = []
    for p in range(pp):
        lo, hi = pp_layer_range(model.layers, pp, p)
        shapes.append((hi - lo, p == 0, p == pp - 1, pp - p if stage == "training" else 0))
    return shapes


@lru_cache(maxsize=4096)
def _resident_rows(module: Module, model_stage: ModelStage, dp: int, tp: int, pp: int, zero: int, ep: int,
                   every_replica: bool) -> tuple[tuple, tuple]:
    """(resident rows, host rows) of `UnitMemory`: they do not depend on the workload."""
    model = module.model(model_stage.model)
    stage = model_stage.stage
    seen: dict = {}
    resident, host = [], []
    for r in range(dp) if every_replica else range(1):
        row, held = [], []
        for p, shape in enumerate(_stage_shapes(model, stage, pp)):
            if (shape, r) not in seen:
                by_kind = unit_resident_bytes(model, stage, dp, tp, pp, p, ep, zero, r)
                seen[(shape, r)] = (sum(by_kind.values()), host_held_bytes(by_kind))
            row.append(seen[(shape, r)][0])
            held.append(seen[(shape, r)][1])
        resident.append(tuple(row))
        host.append(tuple(held))
    return tuple(resident), tuple(host)


@lru_cache(maxsize=16384)
def _working_row(module: Module, workload: Workload, model_stage: ModelStage, dp: int, tp: int, pp: int, zero: int,
                 ep: int) -> tuple:
    model = module.model(model_stage.model)
    stage = model_stage.stage
    if stage == "generation":
        # one sequence per GPU: the KV cache, logits and dispatch buffers scale linearly with it
        sized = replace(module, workload=replace(workload, batch=dp * ep))
    else:
        sized = module if module.workload == workload else replace(module, workload=workload)
    seen: dict = {}
    row = []
    for p, shape in enumerate(_stage_shapes(model, stage, pp)):
        if shape not in seen:
            seen[shape] = sum(unit_working_bytes(sized, model, stage, dp, tp, pp, p, ep, zero).values())
        row.append(seen[shape])
    return tuple(row)


def gpu_sequences(batch: int, dp: int, ep: int = 1) -> int:
    """Sequences one GPU of a generation unit decodes: ⌈batch / (dp·ep)⌉ (the EP ranks of a
    replica decode different sequences; the feasibility pass's count)."""
    return -(-batch // (dp * ep))


def active_stages(workload: Workload) -> tuple[str, ...]:
    return tuple(s for s in STAGES if workload.models_in(s))


def waves_for(free: np.ndarray, per_sequence: np.ndarray, sequences: int, allow_waves: bool) -> int:
    """Waves a generation unit needs: 1 if all `sequences` (per GPU: `gpu_sequences`) fit in
    `free` bytes on every GPU, else ⌈sequences / fit⌉ (allow_waves), else 0 meaning infeasible."""
    need = per_sequence > 0
    if not need.any():
        return 1 if (free >= 0).all() else 0
    if (free < 0).any():
        return 0
    fit = int(np.floor(np.min(free[need] / per_sequence[need])))
    if fit >= sequences:
        return 1
    if not allow_waves or fit < 1:
        return 0
    return math.ceil(sequences / fit)


@dataclass(frozen=True)
class PlanMemory:
    feasible: bool
    waves: dict  # ModelStage -> waves (generation units)
    worst_gpu: int
    worst_stage: str
    worst_bytes: int
    capacity_bytes: int
    # offloaded state in host memory: the fullest node and its bytes (-1, 0 without offload)
    host_node: int = -1
    host_bytes: int = 0
    host_capacity_bytes: int = 0

    def why_not(self) -> str:
        """Why the plan does not fit, in the check's words ('' when it fits)."""
        from nereus.ir.units import human_bytes

        if self.feasible:
            return ""
        if self.worst_bytes <= self.capacity_bytes and self.host_bytes > self.host_capacity_bytes:
            return (f"node {self.host_node} holds {human_bytes(self.host_bytes)} of offloaded state in host memory "
                    f"but has {human_bytes(self.host_capacity_bytes)}")
        return (f"GPU {self.worst_gpu} needs {human_bytes(self.worst_bytes)} in {self.worst_stage} "
                f"but has {human_bytes(self.capacity_bytes)}")


def _period(plan: Plan):
    """Q = lcm of every placement's replica mesh tp·ep·pp (of its whole GPU count under ZeRO,
    whose replicas hold different chunks) when every placement covers the same GPUs 0..G−1 in
    order (then GPU g holds what GPU g mod Q holds, and Q columns give the same answer as G);
    else None."""
    size = len(plan.placements[0].gpus) if plan.placements else 0
    ordered = tuple(range(size))
    if any(p.gpus != ordered for p in plan.placements):
        return None
    sizes = [p.world if p.zero and p.model_stage.stage == "training" else p.tp * p.ep * p.pp
             for p in plan.placements]
    period = math.lcm(*sizes) if sizes else 0
    return period if period and size % period == 0 else None


def plan_memory(module: Module, workload: Workload, plan: Plan, allow_waves: bool = True) -> PlanMemory:
    """Per-(GPU, stage) memory of an arbitrary plan under `workload`, with generation waves,
    and its offloaded state against each node's host memory.

    Output: PlanMemory; with allow_waves=False `feasible` and `worst_bytes` equal the
    feasibility pass's (module docstring)."""
    stages = active_stages(workload)
    light_module = light(module)
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
        unit = unit_memory(light_module, workload, ms, placement.dp, placement.tp, placement.pp, placement.offload,
                           placement.zero, placement.ep)
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
        sequences = gpu_sequences(workload.batch, placement.dp, placement.ep)
        free = capacity - resident[x, index]
        w = waves_for(free, per_sequence, sequences, allow_waves)
        waves[placement.model_stage] = max(w, 1)
        if w == 0:
            feasible = False
            w = 1
        working[x, index] = np.maximum(working[x, index], per_sequence * math.ceil(sequences / w))
    usage = resident + working
    flat = int(np.argmax(usage))
    stage_i, gpu = divmod(flat, gpus)
    worst = int(usage[stage_i, gpu])
    host = _host_bytes(light_module, plan)
    node, on_host = max(host.items(), key=lambda item: (item[1], -item[0])) if host else (-1, 0)
    host_capacity = module.cluster.host_mem_bytes
    return PlanMemory(feasible and worst <= capacity and on_host <= host_capacity, waves, gpu, stages[stage_i], worst,
                      capacity, node, on_host, host_capacity)


def _host_bytes(module: Module, plan: Plan) -> dict:
    """{node: bytes} of the plan's offloaded state (the feasibility pass's count; {} when
    nothing is offloaded, without building the pass's per-GPU lists)."""
    if not any(p.offload for p in plan.placements):
        return {}
    return _offloaded(module, plan.placements)


@lru_cache(maxsize=1024)
def _offloaded(module: Module, placements: tuple) -> dict:
    offloaded = tuple(p for p in placements if p.offload)
    return offloaded_host_bytes(module, Plan("host", None, offloaded, offloaded))
