"""feasibility: plan → FeasibilityReport. Does every GPU fit in every stage?

Input: a validated `Module` and one of its plans. Output: a `FeasibilityReport` with the
bytes in use on every (GPU, stage) pair, split into named contributors, and the worst
pair, and the bytes offloaded model-stages keep in each node's host memory. Invariant:
`report.feasible` iff every GPU × stage total ≤ usable memory (`gpu.mem × (1 − reserve)`)
and every node's offloaded state ≤ its `host_mem`. The pass is pure and never mutates its
input.

Memory model (docs/ir.md, "The memory model"; sources cited per term):

Resident state of a model-stage on a GPU, present in every stage of the step (unless the
model-stage is marked `offload`, in which case it is resident only during its own stage
and waits in host memory otherwise):
  - weights: the exact shard of every tensor that the GPU's (tp rank, pp stage) holds —
    column tensors split part-wise (a KV head is replicated when tp > kv_heads, as in
    Megatron-LM and vLLM), row and vocab tensors split by tp, replicated tensors whole;
    embed on the first PP stage, final norm and head on the last (Megatron's uneven
    contiguous layer split: the first `layers % pp` stages hold one more layer).
  - training units additionally hold bf16 gradients (dtype bytes/param) and fp32 master
    weights, Adam m and v (12 B/param): 16 B/param for bf16 weights, as in the ZeRO paper
    (Rajbhandari et al. 2019, §3.1) without optimizer-state sharding. With `zero 1`
    (ZeRO stage 1, Megatron's distributed optimizer) the 12 B/param are split over the dp
    replicas: 2 + 2 + 12/dp B/param, exactly the chunk each replica holds
    (nereus.passes.layout.zero_boxes: ceil-sized dim-0 chunks, so replica 0 holds the most).
    With `zero 3` (ZeRO stage 3, FSDP) the weights and grads are chunked too: 16/dp
    B/param, plus working memory in training for 3 layers all-gathered to whole TP shards
    (the computed layer, the prefetched one, one layer of grads before reduce-scatter).

Working memory of a model-stage, only during its own stage; model-stages that share a
GPU in one stage run one after another, so only the largest working set counts (b = microbatch, s = prompt +
response, h = hidden, a = heads, t = tp, L_p = layers on the GPU's PP stage, V = vocab):
  - generation: the KV cache, 2·L_p·kv_per_rank·head_dim·bytes per token for the
    replica's share of the batch, batch/dp sequences of s tokens (kv_per_rank =
    kv_heads/t, or 1 when t > kv_heads); plus fp32 logits of the decode batch,
    4·(batch/dp)·V/t on the last stage.
  - training: activations per layer per microbatch s·b·h·(34 + 5·a·s/h)/t bytes
    (Korthikanti et al. 2022, arXiv 2205.05198, TP without sequence parallelism, 16-bit);
    with the workload's `recompute selective` 34·s·b·h/t (attention core recomputed, the
    FlashAttention case), with `recompute full` 2·s·b·h (layer inputs only);
    for L_p layers, with 1F1B keeping (pp − stage) microbatches in flight on a stage;
    plus fp32 logits 4·b·s·V/t on the last stage (log-probs and entropy; a value head's
    4·b·s values are not split by tp, here and below).
  - mixture of experts (ep, qwen3_moe): expert weights count on the EP rank that holds
    them (experts / ep whole experts per GPU, TP-split inside), with their grads and Adam
    state in training, like every other weight; attention, router, embed and head on every
    EP rank. Working memory adds the all-to-all "dispatch" buffers of one MoE layer,
    2·tokens·experts_per_token·h·bytes (tokens sent to their experts and the outputs
    returned; tokens = b·s in training and inference, the decode batch in generation), and
    in generation the EP ranks of a replica decode batch/(dp·ep) sequences each (attention
    is data-parallel across them). The MoE layer's activations use the dense formula above.
  - inference: one microbatch's forward: one layer's activations s·b·h·(34 + 5·a·s/h)/t
    (forward only; layer activations are not kept) plus fp32 logits 4·b·s·V/t on the last
    stage.
These are upper-bound estimates that the controller calibrates against measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from nereus.models import pp_layer_range
from nereus.ir.model import STAGES, Model, Module, Placement, Plan

from .layout import kind_volume, mesh_shard_elements, shard_elements, zero_shard_elements

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master + Adam exp_avg + exp_avg_sq
GIB = 1024**3


@lru_cache(maxsize=4096)
def _stage_params(model: Model, tp: int, pp: int, pp_stage: int, ep: int = 1) -> int:
    """Parameters on one GPU of (tp, ep, pp stage): the layout pass's exact shard sizes
    (every stage rank holds the same amount: replicated KV heads included, and each EP
    rank experts / ep whole experts, as validation makes ep divide experts)."""
    return shard_elements(model, tp, pp, pp_stage, 0, ep)


def model_state_bytes_per_gpu(model: Model, stage: str, tp: int, pp: int, pp_stage: int, dp: int = 1,
                              zero: int = 0, replica: int = 0, ep: int = 1) -> dict[str, int]:
    """Resident bytes on one GPU of a unit at (tp, pp, pp_stage, ep), by kind:
    {"weights": n} and, for training units, also "grads" and "optimizer" (under zero >= 1,
    replica `replica`'s chunk of a dp-way split; zero needs ep 1)."""
    params = _stage_params(model, tp, pp, pp_stage, ep)
    out = {"weights": params * model.dtype_bytes}
    if stage == "training":
        owned = zero_shard_elements(model, tp, pp, pp_stage, 0, dp, replica) if zero >= 1 else params
        if zero >= 3:  # weights and grads sharded like the optimizer state
            out["weights"] = owned * model.dtype_bytes
        out["grads"] = (owned if zero >= 3 else params) * model.dtype_bytes
        out["optimizer"] = owned * OPTIMIZER_BYTES_PER_PARAM
    return out


def gathered_bytes_per_gpu(model: Model, tp: int) -> int:
    """ZeRO-3 working memory of a training GPU: the layer being computed and the next one
    (prefetched) all-gathered to whole TP shards, and one layer's unsharded grads before
    their reduce-scatter: 3 layers x TP-shard parameters x dtype bytes."""
    return 3 * kind_volume(model, tp, 0)["layer"] * model.dtype_bytes


def _activation_bytes_per_layer(model: Model, seq: int, micro: int, tp: int, recompute: str = "none") -> float:
    s, b, h, a = seq, micro, model.hidden, model.heads
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":
        return 34 * s * b * h / tp
    return s * b * h * (34 + 5 * a * s / h) / tp


def _dispatch_bytes(model: Model, tokens: int) -> int:
    """One MoE layer's all-to-all buffers for `tokens` tokens on a GPU: each token is sent
    to experts_per_token experts and their outputs come back (dispatch + combine), hidden
    values each at the model dtype. 0 for a dense model."""
    return 2 * tokens * model.experts_per_token * model.hidden * model.dtype_bytes if model.experts else 0


def _logits_per_token(model: Model, tp: int) -> int:
    """fp32 outputs of the head per token on a last-stage GPU: V/t logits of a vocab-parallel
    lm head (validation makes tp divide vocab), one value of a value head (not split). Whole
    bytes per token, so the working set is linear in the tokens: the controller sizes the
    KV cache per sequence (nereus.controller.memory) and gets these bytes exactly."""
    return 4 * (model.vocab // tp if model.head == "lm" else 1)


def working_bytes_per_gpu(module: Module, model: Model, stage: str, dp: int, tp: int, pp: int,
                          pp_stage: int, ep: int = 1) -> dict[str, int]:
    """Working bytes on one GPU of a unit at (dp, tp, pp, pp_stage, ep) during its own
    stage, by kind ("kv_cache", "logits", "activations", "dispatch")."""
    workload = module.workload
    seq = workload.sequence
    lo, hi = pp_layer_range(model.layers, pp, pp_stage)
    layers_here = hi - lo
    last = pp_stage == pp - 1
    micro = workload.microbatch
    if stage == "generation":
        # ceil: the largest share; the EP ranks of a replica decode different sequences
        sequences = -(-workload.batch // (dp * ep))
        kv_per_rank = model.kv_heads // tp if tp <= model.kv_heads else 1
        per_token = 2 * layers_here * kv_per_rank * model.head_dim * model.dtype_bytes
        out = {"kv_cache": per_token * sequences * seq}
        if last:
            out["logits"] = sequences * _logits_per_token(model, tp)
        if layers_here and model.experts:
            out["dispatch"] = _dispatch_bytes(model, sequences)  # one decode step's tokens
        return out
    act = _activation_bytes_per_layer(model, seq, micro, tp, workload.recompute)
    logits = micro * seq * _logits_per_token(model, tp) if last else 0
    if stage == "training":
        in_flight = pp - pp_stage
        out = {"activations": int(act * layers_here * in_flight)}
    else:
        # a forward pass holds one layer's working set at a time; recomputation does not
        # shrink it, but a workload that recomputes attention uses a fused (flash) kernel
        mode = "none" if workload.recompute == "none" else "selective"
        one_layer = _activation_bytes_per_layer(model, seq, micro, tp, mode)
        out = {"activations": int(one_layer) if layers_here else 0}
    if logits:
        out["logits"] = logits
    if layers_here and model.experts:
        # one layer's all-to-all at a time (forward, and again in backward): not kept per layer
        out["dispatch"] = _dispatch_bytes(model, micro * seq)
    return out


@dataclass(frozen=True)
class Contributor:
    model_stage: str
    kind: str  # weights, grads, optimizer, kv_cache, activations, logits
    bytes: int


@dataclass(frozen=True)
class GpuStageUse:
    gpu: int
    stage: str
    bytes: int
    contributors: tuple[Contributor, ...]  # largest first


@dataclass(frozen=True)
class FeasibilityReport:
    plan: str
    capacity_bytes: int
    feasible: bool
    worst: GpuStageUse
    overflowing: tuple[GpuStageUse, ...]  # every (gpu, stage) over capacity, worst first
    resident_bytes: dict = field(compare=False)  # gpu -> bytes resident at the step boundary
    totals: dict = field(compare=False, default_factory=dict)  # (gpu, stage) -> bytes in use
    # offloaded model-stages wait in their nodes' host memory: node -> bytes, and the nodes
    # over host_mem, most over first ((node, bytes), ...)
    host_bytes: dict = field(compare=False, default_factory=dict)
    host_capacity_bytes: int = 0
    host_overflowing: tuple = ()

    def bytes_on(self, gpu: int, stage: str) -> int:
        return self.totals.get((gpu, stage), 0)

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.worst.bytes

    def to_json(self) -> dict:
        def use(u: GpuStageUse) -> dict:
            return {"gpu": u.gpu, "stage": u.stage, "bytes": u.bytes,
                    "contributors": [{"model_stage": c.model_stage, "kind": c.kind, "bytes": c.bytes}
                                     for c in u.contributors]}

        return {"plan": self.plan, "feasible": self.feasible, "capacity_bytes": self.capacity_bytes,
                "headroom_bytes": self.headroom_bytes, "worst": use(self.worst),
                "overflowing": [use(u) for u in self.overflowing[:16]],
                "overflowing_count": len(self.overflowing),
                "host": {"capacity_bytes": self.host_capacity_bytes,
                         "bytes": {str(node): n for node, n in sorted(self.host_bytes.items())},
                         "overflowing": [{"node": node, "bytes": n} for node, n in self.host_overflowing[:16]]}}


def unit_resident_bytes(model: Model, stage: str, dp: int, tp: int, pp: int, pp_stage: int, ep: int = 1,
                        zero: int = 0, replica: int = 0) -> dict[str, int]:
    """Resident bytes by kind on one GPU of pipeline stage `pp_stage` of replica `replica` of a
    (dp, tp, pp, ep, zero) unit of `model` in `stage` (zero counts in training only). With
    `unit_working_bytes`, the per-GPU rule that this pass and the controller's plan search
    (nereus.controller.memory) both apply."""
    zero = zero if stage == "training" else 0
    return model_state_bytes_per_gpu(model, stage, tp, pp, pp_stage, dp, zero, replica, ep=ep)


def unit_working_bytes(module: Module, model: Model, stage: str, dp: int, tp: int, pp: int, pp_stage: int,
                       ep: int = 1, zero: int = 0) -> dict[str, int]:
    """Working bytes by kind on one GPU of pipeline stage `pp_stage` of such a unit during its
    own stage (the same on every replica): `working_bytes_per_gpu`, plus ZeRO-3's gathered
    layers in training."""
    working = working_bytes_per_gpu(module, model, stage, dp, tp, pp, pp_stage, ep)
    if stage == "training" and zero >= 3:
        working = dict(working, gathered=gathered_bytes_per_gpu(model, tp))
    return working


def host_held_bytes(resident: dict[str, int]) -> int:
    """Of a GPU's resident bytes by kind, what an offloaded unit keeps in host memory between
    its stages: weights and optimizer state; gradients are not kept between steps (they are
    zeroed at the boundary)."""
    return sum(n for kind, n in resident.items() if kind != "grads")


def _placement_contributions(module: Module, placement: Placement):
    """Yield (gpus, resident_by_kind, working_by_kind) once per PP stage: every TP rank and
    replica of a stage holds the same amount (every TP rank of a replica under zero, whose
    chunks differ between replicas by up to one row: then once per (replica, PP stage))."""
    model = module.model(placement.model_stage.model)
    stage = placement.model_stage.stage
    if placement.layout is not None:
        yield from _mesh_contributions(model, placement)
        return
    zero = placement.zero if stage == "training" else 0
    dp, tp, pp, ep = placement.dp, placement.tp, placement.pp, placement.ep
    for p in range(pp):
        working = unit_working_bytes(module, model, stage, dp, tp, pp, p, ep, zero)
        for r in range(dp) if zero else (None,):
            resident = unit_resident_bytes(model, stage, dp, tp, pp, p, ep, zero, r or 0)
            yield _gpus_of_pp_stage(placement, p, r), resident, working


def _mesh_contributions(model: Model, placement: Placement):
    """A mesh layout of a `tensors` model: per GPU, the bytes of its shards (weights and,
    for a training unit, the states the model declares, all in its dtype); no working
    memory: a tensor table says nothing of activations (docs/ir.md)."""
    per = model.dtype_bytes
    states = len(model.states) if placement.model_stage.stage == "training" else 0
    for rank, gpu in enumerate(placement.gpus):
        elements = mesh_shard_elements(model, placement, rank)
        resident = {"weights": elements * per}
        if states:
            resident["optimizer"] = elements * per * states
        yield [gpu], resident, {}


def _gpus_of_pp_stage(placement: Placement, pp_stage: int, replica=None) -> list[int]:
    """GPUs of pipeline stage `pp_stage` in every replica (or in `replica`), in `gpu_of`
    order: slices of the GPU list (gpu_of per GPU costs ~10^5 calls at 4,096 GPUs)."""
    width, gpus = placement.stage_width, placement.gpus
    out: list[int] = []
    for r in range(placement.dp) if replica is None else (replica,):
        start = (r * placement.pp + pp_stage) * width
        out.extend(gpus[start:start + width])
    return out


def resident_bytes_by_model_stage(module: Module, plan: Plan) -> dict[str, dict[int, int]]:
    """Step-boundary resident bytes of each model-stage on each GPU it occupies
    ({model_stage: {gpu: bytes}}); offloaded model-stages hold nothing on GPUs then."""
    return {str(placement.model_stage): placement_resident_bytes(module, placement) for placement in plan.placements}


def placement_resident_bytes(module: Module, placement: Placement) -> dict[int, int]:
    """Step-boundary resident bytes of one model-stage on each GPU it occupies (weights;
    training: + grads + fp32 master/m/v); {} when offloaded (it waits in host memory)."""
    per_gpu: dict[int, int] = {}
    if not placement.offload:
        for gpus, resident, _ in _placement_contributions(module, placement):
            total = sum(resident.values())
            for gpu in gpus:
                per_gpu[gpu] = total
    return per_gpu


def resident_bytes_per_gpu(module: Module, plan: Plan) -> dict[int, int]:
    """Step-boundary resident bytes per GPU, summed over model-stages."""
    totals: dict[int, int] = {}
    for per_gpu in resident_bytes_by_model_stage(module, plan).values():
        for gpu, n in per_gpu.items():
            totals[gpu] = totals.get(gpu, 0) + n
    return totals


def check_plan(module: Module, plan: Plan | str) -> FeasibilityReport:
    """Memory feasibility of `plan`: every (GPU, stage) total against usable memory."""
    if isinstance(plan, str):
        plan = module.plan(plan)
    capacity = module.cluster.usable_gpu_bytes
    # (gpu, stage) -> {(model_stage, kind): bytes}; working memory kept per model-stage
    # because model-stages sharing a GPU in one stage run one after another: only the
    # largest working set is live at a time.
    stages = [s for s in STAGES if module.workload.models_in(s)]
    contributions = []  # (model-stage, its stage, offload, resident_by_kind, working_by_kind)
    signature: dict[int, list[int]] = {}  # gpu -> the contributions it receives, in plan order
    for placement in plan.placements:
        for gpus, resident, working in _placement_contributions(module, placement):
            signature_id = len(contributions)
            contributions.append((str(placement.model_stage), placement.model_stage.stage, placement.offload,
                                  resident, working))
            for gpu in gpus:
                signature.setdefault(gpu, []).append(signature_id)
    # GPUs that receive the same contributions use the same memory: one cell per class and
    # stage (a few hundred classes at 4,096 GPUs instead of a dict per GPU and stage)
    classes: dict[tuple, list[int]] = {}
    for gpu, ids in signature.items():
        classes.setdefault(tuple(ids), []).append(gpu)
    usage: dict[tuple[int, str], dict[tuple[str, str], int]] = {}
    resident_per_gpu: dict[int, int] = {}
    for ids, gpus in classes.items():
        resident_total = sum(sum(contributions[c][3].values()) for c in ids if not contributions[c][2])
        for stage in stages:
            cell: dict[tuple[str, str], int] = {}
            candidates: dict[str, dict[str, int]] = {}
            for c in ids:
                name, own, offload, resident, working = contributions[c]
                if not offload or stage == own:
                    for kind, n in resident.items():
                        cell[(name, kind)] = cell.get((name, kind), 0) + n
                if own == stage:
                    candidates[name] = {k: n for k, n in working.items() if n}
            if candidates:
                name, working = max(candidates.items(), key=lambda item: (sum(item[1].values()), item[0]))
                for kind, n in working.items():
                    cell[(name, kind)] = cell.get((name, kind), 0) + n
            for gpu in gpus:
                usage[(gpu, stage)] = cell
        if any(not contributions[c][2] for c in ids):  # only offloaded model-stages: none resident
            for gpu in gpus:
                resident_per_gpu[gpu] = resident_total

    def summarise(key, cell) -> GpuStageUse:
        contributors = tuple(sorted((Contributor(ms, kind, n) for (ms, kind), n in cell.items()),
                                    key=lambda c: (-c.bytes, c.model_stage, c.kind)))
        return GpuStageUse(key[0], key[1], sum(c.bytes for c in contributors), contributors)

    totals = {key: sum(cell.values()) for key, cell in usage.items()}
    order = sorted(totals, key=lambda k: (-totals[k], k[0], STAGES.index(k[1])))
    worst = summarise(order[0], usage[order[0]])
    overflowing = tuple(summarise(k, usage[k]) for k in order if totals[k] > capacity)
    host = offloaded_host_bytes(module, plan)
    host_capacity = module.cluster.host_mem_bytes
    host_over = tuple(sorted(((node, n) for node, n in host.items() if n > host_capacity), key=lambda x: (-x[1], x[0])))
    return FeasibilityReport(plan.name, capacity, not overflowing and not host_over, worst, overflowing,
                             resident_per_gpu, totals, host, host_capacity, host_over)


def offloaded_host_bytes(module: Module, plan: Plan) -> dict[int, int]:
    """Bytes of offloaded model-stages' state in each node's host memory at a step
    boundary ({node: bytes}): every shard of an offloaded unit waits on the host of the
    node of the GPU that computes it, as the verifier's replay counts it."""
    per_node: dict[int, int] = {}
    width = module.cluster.gpus_per_node
    for placement in plan.placements:
        if not placement.offload:
            continue
        for gpus, resident, _ in _placement_contributions(module, placement):
            total = host_held_bytes(resident)
            for gpu in gpus:
                per_node[gpu // width] = per_node.get(gpu // width, 0) + total
    return per_node


def check_module(module: Module) -> list[FeasibilityReport]:
    return [check_plan(module, plan) for plan in module.plans]
