"""Predicted latency of every model-stage under a (dp, tp, pp) layout, calibrated online.

A model-stage's latency is T = Σ_j θ_j·φ_j, φ the stage terms below (seconds at nominal
rates), θ ≥ 0 fitted per model-stage by non-negative least squares on relative error to the
job's own measurements (`CostModel.observe`), pulled toward a prior (θ = 1: the per-layer
H200 calibration is trusted until the job says otherwise). Sources: Narayanan et al. SC'21
(FLOPs, pipeline schedule), Korthikanti et al. 2022 (activations), Megatron-LM (two
all-reduces per layer forward, two backward), the ZeRO paper (16 B/param), vLLM (CUDA-graph
decode, KV cache).

Notation: L layers, h hidden, V vocab, t/p/d = tp/pp/dp, B = workload.batch sequences,
s_p prompt, n response, S = s_p + n, b = microbatch, L_p = ⌈L/p⌉, B_r = ⌈B/d⌉ sequences per
replica, M = ⌈B_r/b⌉ microbatches, Ψ_g = parameters on the largest pipeline stage of a GPU.
τ_layer(kind, …) is the calibrated per-layer time of `layer_model` (roofline + fitted θ on a
measured H200 table, held-out MAPE ≤ 5.1%), head(kind, …) the same roofline for the
lm_head (vocab-parallel, h·V/t parameters). AR(x, t, B) = λ + 2(t−1)/t·x/B (ring all-reduce
of x bytes; 0 when t = 1).

  training  (1F1B, Narayanan et al.):
    compute   = (M + p − 1)·[L_p·τ_layer(fwdbwd, b, S)·r + head(fwdbwd)]   r = 4/3 with
                `recompute full` (Korthikanti et al.: one extra forward), else 1
    tp        = (M + p − 1)·L_p·4·AR(b·S·h·2, t, B_intra)
    pp        = 2(p − 1)·[λ + b·S·h·2/(t·B_pp)]
    dp        = AR(2Ψ_g, d, B_dp)                   (gradient all-reduce, not overlapped; under
                `zero 1` a reduce-scatter and an all-gather of the same bytes, under `zero 3`
                1.5× (weights gathered for forward and backward): the ZeRO paper, §7)
    optimizer = 28·Ψ_g/W                            (Adam: grad+master+m+v read, written; /d
                under zero ≥ 1: each replica updates its chunk)
  inference:
    compute   = (M + p − 1)·[L_p·τ_layer(forward, b, S) + head(forward)]
    tp        = (M + p − 1)·L_p·2·AR(b·S·h·2, t, B_intra);   pp = (p − 1)·[λ + b·S·h·2/(t·B_pp)]
    offload   = resident bytes per GPU / host link (25 GB/s assumed, PCIe 5 x16 at half rate)
  generation (w waves of B_w = ⌈B_r/w⌉ sequences, M_g = min(p, B_w) microbatches of
    b_g = B_w/M_g; a decode round passes every microbatch through every stage):
    compute   = w·[(M_g + p − 1)·τ_pre + (n − 1)·max(M_g, p)·τ_dec]
                τ_pre = L_p·τ_layer(forward, b_g, s_p) + head(decode, b_g)
                τ_dec = L_p·τ_layer(decode, b_g, context s_p + n/2) + head(decode, b_g)
    tp        = w·[(M_g + p − 1)·L_p·2·AR(b_g·s_p·h·2) + (n − 1)·max(M_g, p)·L_p·2·AR(b_g·h·2)]
    pp        = w·n·(p − 1)·λ
  every stage: fixed = 1 s (a per-step constant the fit may use; prior θ = 0)

Waves w are forced by KV memory (T_gen): the memory pass (`memory.py`) gives the
largest per-replica batch whose KV cache fits beside everything resident.

Links: B_intra = cluster.intra (TP groups sit inside a node: the search keeps them there);
B_pp = intra when a replica's tp·pp GPUs fit in a node, else inter/gpus_per_node; B_dp =
inter/gpus_per_node unless the whole model-stage fits in a node. λ = 8 µs inside a node,
25 µs across nodes (NCCL small-message latency; calibrated through θ_tp, θ_pp, θ_dp).

Step latency (`step_seconds`): stages run in workload order; inside a stage, model-stages on
disjoint GPUs run concurrently and those sharing GPUs run one after another, so a stage
takes the largest sum of model-stage times over any one GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from nereus.ir.model import STAGES, Model, ModelStage, Module, Plan, Workload

from .calibrated import LAYER_THETA
from .layer_model import LayerShape, layer_features
from .nnls import fit_relative

TERMS = ("compute", "tp", "pp", "dp", "optimizer", "offload", "fixed")
PRIOR = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
LATENCY_INTRA = 8e-6
LATENCY_INTER = 25e-6
HOST_LINK_BYTES_PER_S = 25e9
ADAM_BYTES_PER_PARAM = 28
# ZeRO-3 moves 3Ψ per step against data parallelism's 2Ψ (Rajbhandari et al. 2019, §7.2.2)
ZERO3_COMMUNICATION = 1.5
RECOMPUTE_FULL_FACTOR = 4.0 / 3.0  # one more forward per forward+backward (fwd 1 + bwd 2 + refwd 1)


@dataclass(frozen=True)
class Layout:
    """What the cost model needs to know about one model-stage's placement."""

    dp: int
    tp: int
    pp: int
    offload: bool = False
    waves: int = 1
    spans_nodes: bool = True  # the model-stage's GPUs cover more than one node
    zero: int = 0  # ZeRO stage of a training unit (0 elsewhere)


def _allreduce(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    if ranks <= 1:
        return 0.0
    return latency + 2.0 * (ranks - 1) / ranks * nbytes / bandwidth


def _layer_seconds(kind: str, shape: LayerShape, batch: float, seq: float, context: float,
                   flops: float, hbm: float, dtype_bytes: int) -> float:
    features = layer_features(kind, shape, batch, seq, context, flops, hbm, dtype_bytes)
    return float(np.dot(LAYER_THETA[kind], features))


def _head_seconds(kind: str, model: Model, tp: int, tokens: float, flops: float, hbm: float) -> float:
    """The lm_head (or value head) matmul as a roofline with the measured forward/decode roof
    θ; forward+backward costs three forward matmuls."""
    vocab = model.vocab if model.head == "lm" else 1
    params = model.hidden * vocab / (tp if vocab > 1 else 1)
    passes = 3.0 if kind == "fwdbwd" else 1.0
    roof = LAYER_THETA["decode" if kind == "decode" else "forward"][0]
    dense = 2.0 * params * tokens / flops
    memory = model.dtype_bytes * params / hbm
    return passes * roof * max(dense, memory)


def _stage_params(model: Model, tp: int, pp: int) -> float:
    """Parameters on one GPU of the largest pipeline stage (layers plus the bigger edge)."""
    shape = LayerShape.of(model.hidden, model.heads, model.kv_heads, model.ffn, tp)
    vocab_share = model.vocab * model.hidden / tp
    return math.ceil(model.layers / pp) * shape.params + vocab_share


def stage_terms(module: Module, workload: Workload, model_stage: ModelStage, layout: Layout) -> np.ndarray:
    """φ (TERMS order, seconds at θ = 1) of one model-stage under `layout` for `workload`.

    Pure: depends only on its arguments. See the module docstring for each formula."""
    cluster = module.cluster
    model = module.model(model_stage.model)
    flops, hbm = cluster.gpu.flops, cluster.gpu.hbm_bytes_per_s
    t, p, d = layout.tp, layout.pp, layout.dp
    shape = LayerShape.of(model.hidden, model.heads, model.kv_heads, model.ffn, t)
    nbytes = model.dtype_bytes
    h = model.hidden
    layers_here = math.ceil(model.layers / p)
    per_node = cluster.gpus_per_node
    inter_per_gpu = cluster.inter_bytes_per_s / per_node
    b_tp, lat_tp = cluster.intra_bytes_per_s, LATENCY_INTRA
    if t * p <= per_node:
        b_pp, lat_pp = cluster.intra_bytes_per_s, LATENCY_INTRA
    else:
        b_pp, lat_pp = inter_per_gpu, LATENCY_INTER
    if layout.spans_nodes:
        b_dp, lat_dp = inter_per_gpu, LATENCY_INTER
    else:
        b_dp, lat_dp = cluster.intra_bytes_per_s, LATENCY_INTRA
    replica_batch = math.ceil(workload.batch / d)
    seq = workload.sequence
    phi = np.zeros(len(TERMS))
    phi[TERMS.index("fixed")] = 1.0
    stage = model_stage.stage
    if stage in ("training", "inference"):
        kind = "fwdbwd" if stage == "training" else "forward"
        micro = min(workload.microbatch, replica_batch)
        m = math.ceil(replica_batch / micro)
        slots = m + p - 1
        tau = layers_here * _layer_seconds(kind, shape, micro, seq, seq, flops, hbm, nbytes)
        if stage == "training" and workload.recompute == "full":
            tau *= RECOMPUTE_FULL_FACTOR
        tau += _head_seconds(kind, model, t, micro * seq, flops, hbm)
        phi[0] = slots * tau
        per_layer_ar = 4 if stage == "training" else 2
        phi[1] = slots * layers_here * per_layer_ar * _allreduce(micro * seq * h * nbytes, t, b_tp, lat_tp)
        hops = 2 * (p - 1) if stage == "training" else (p - 1)
        phi[2] = hops * (lat_pp + micro * seq * h * nbytes / (t * b_pp)) if p > 1 else 0.0
        params = _stage_params(model, t, p)
        if stage == "training":
            phi[3] = _allreduce(nbytes * params, d, b_dp, lat_dp) * (ZERO3_COMMUNICATION if layout.zero >= 3 else 1.0)
            phi[4] = ADAM_BYTES_PER_PARAM * params / hbm / (d if layout.zero else 1)
        elif layout.offload:
            phi[5] = nbytes * params / HOST_LINK_BYTES_PER_S
        return phi
    if stage != "generation":
        raise ValueError(f"unknown stage {stage!r}")
    waves = max(1, layout.waves)
    wave_batch = math.ceil(replica_batch / waves)
    m = min(p, wave_batch)
    micro = wave_batch / m
    rounds = max(m, p)
    steps = max(0, workload.response - 1)
    context = workload.prompt + workload.response / 2.0
    tau_pre = layers_here * _layer_seconds("forward", shape, micro, workload.prompt, workload.prompt,
                                           flops, hbm, nbytes) + _head_seconds("decode", model, t, micro, flops, hbm)
    tau_dec = layers_here * _layer_seconds("decode", shape, micro, 1, context, flops, hbm, nbytes) \
        + _head_seconds("decode", model, t, micro, flops, hbm)
    phi[0] = waves * ((m + p - 1) * tau_pre + steps * rounds * tau_dec)
    ar_pre = _allreduce(micro * workload.prompt * h * nbytes, t, b_tp, lat_tp)
    ar_dec = _allreduce(micro * h * nbytes, t, b_tp, lat_tp)
    phi[1] = waves * ((m + p - 1) * layers_here * 2 * ar_pre + steps * rounds * layers_here * 2 * ar_dec)
    phi[2] = waves * workload.response * (p - 1) * lat_pp
    return phi


def layout_of(module: Module, placement, waves: int = 1) -> Layout:
    """The Layout of a plan's placement."""
    per_node = module.cluster.gpus_per_node
    first = placement.gpus[0] // per_node
    spans = any(g // per_node != first for g in placement.gpus)
    zero = placement.zero if placement.model_stage.stage == "training" else 0
    return Layout(placement.dp, placement.tp, placement.pp, placement.offload, waves, spans, zero)


def workload_key(workload: Workload) -> tuple:
    return (workload.batch, workload.prompt, workload.response, workload.microbatch, workload.recompute)


@dataclass
class CostModel:
    """Stage latency model with per-model-stage coefficients fitted to observations.

    `observe` records (φ, seconds); `theta(ms)` refits lazily; `predict` = θ·φ.
    `prior_weight` pulls θ toward PRIOR (relative-error units): small enough that a handful of
    observations dominate, large enough that unobserved terms stay at the prior."""

    module: Module
    prior_weight: float = 1e-2
    max_rows: int = 200
    _rows: dict = field(default_factory=dict)  # key -> list of (phi, seconds)
    _theta: dict = field(default_factory=dict)  # key -> fitted θ (cache)
    _terms: dict = field(default_factory=dict)  # (ms, layout, workload key) -> φ
    version: int = 0  # bumps when coefficients change (lets callers cache predictions)
    refit_interval: int = 5  # refit θ after this many new rows (every row while fewer than 5)
    fixed_theta: Optional[dict] = None  # str(ms) -> θ, never refitted (a simulator's ground truth)
    _errors: dict = field(default_factory=dict)  # key -> leave-one-out ε (cache)
    _fitted_at: dict = field(default_factory=dict)  # key -> rows when θ was last invalidated
    _layouts: dict = field(default_factory=dict)  # key -> {(dp, tp, pp, offload)} observed

    def terms(self, workload: Workload, model_stage: ModelStage, layout: Layout) -> np.ndarray:
        key = (model_stage, layout, workload_key(workload))
        phi = self._terms.get(key)
        if phi is None:
            if len(self._terms) > 200_000:
                self._terms.clear()
            phi = stage_terms(self.module, workload, model_stage, layout)
            self._terms[key] = phi
        return phi

    def theta(self, model_stage: ModelStage) -> np.ndarray:
        key = str(model_stage)
        if self.fixed_theta is not None:
            return np.asarray(self.fixed_theta.get(key, PRIOR), dtype=float)
        cached = self._theta.get(key)
        if cached is None:
            rows = self._rows.get(key, [])
            if rows:
                x = np.array([r[0] for r in rows])
                y = np.array([r[1] for r in rows])
                cached = fit_relative(x, y, PRIOR, self.prior_weight)
            else:
                cached = PRIOR.copy()
            self._theta[key] = cached
        return cached

    def predict(self, workload: Workload, model_stage: ModelStage, layout: Layout) -> float:
        return float(self.theta(model_stage) @ self.terms(workload, model_stage, layout))

    def observe(self, workload: Workload, model_stage: ModelStage, layout: Layout, seconds: float) -> None:
        """Record one measured latency; the next prediction for this model-stage refits θ."""
        if not seconds > 0:
            return
        key = str(model_stage)
        rows = self._rows.setdefault(key, [])
        rows.append((self.terms(workload, model_stage, layout), float(seconds)))
        self._layouts.setdefault(key, set()).add((layout.dp, layout.tp, layout.pp, layout.offload))
        if len(rows) > self.max_rows:
            del rows[: len(rows) - self.max_rows]
        fitted = self._fitted_at.get(key, 0)
        if len(rows) <= self.refit_interval or len(rows) - fitted >= self.refit_interval or len(rows) < fitted:
            self._theta.pop(key, None)
            self._fitted_at[key] = len(rows)
            self.version += 1

    def observed_layout(self, model_stage: ModelStage, layout: Layout) -> bool:
        """Has this model-stage been measured under this (dp, tp, pp, offload)?"""
        return (layout.dp, layout.tp, layout.pp, layout.offload) in self._layouts.get(str(model_stage), ())

    def observations(self, model_stage: ModelStage) -> int:
        return len(self._rows.get(str(model_stage), []))

    def relative_error(self, model_stage: ModelStage) -> float:
        """RMS relative error ε of this model-stage's fit, inflated by √(n/(n − k)) for the k
        coefficients fitted (an O(1) stand-in for the leave-one-out error that
        `nnls.leave_one_out_error` computes exactly at n fits' cost); NaN with < 2 rows."""
        key = str(model_stage)
        rows = self._rows.get(key, [])
        if len(rows) < 2:
            return float("nan")
        theta = self.theta(model_stage)
        x = np.array([r[0] for r in rows[-50:]])
        y = np.array([r[1] for r in rows[-50:]])
        residual = (x @ theta - y) / y
        fitted = int(np.count_nonzero(theta))
        n = len(y)
        return float(np.sqrt(np.mean(residual ** 2) * n / max(1, n - fitted)))


def step_seconds(module: Module, plan: Plan, stage_times: dict) -> float:
    """Step latency from per-model-stage times {ModelStage: seconds}: stages in order; in
    a stage, the largest per-GPU sum of the times of model-stages placed on that GPU."""
    return sum(stage_breakdown(module, plan, stage_times).values())


def stage_breakdown(module: Module, plan: Plan, stage_times: dict) -> dict[str, float]:
    """{stage: seconds} of the stages `plan` runs, in order (`step_seconds` is their sum)."""
    out = {}
    for stage in STAGES:
        units = [p for p in plan.placements if p.model_stage.stage == stage]
        if not units:
            continue
        if all(p.gpus == units[0].gpus for p in units[1:]):
            out[stage] = sum(stage_times[p.model_stage] for p in units)  # colocated: one after another
            continue
        groups: dict[tuple, float] = {}  # identical GPU sets (the colocated case) add up directly
        for placement in plan.placements:
            if placement.model_stage.stage == stage:
                key = tuple(sorted(placement.gpus))
                groups[key] = groups.get(key, 0.0) + stage_times[placement.model_stage]
        if len(groups) == 1:
            out[stage] = next(iter(groups.values()))
        else:
            per_gpu = np.zeros(module.cluster.num_gpus)
            for gpus, seconds in groups.items():
                per_gpu[list(gpus)] += seconds
            out[stage] = float(per_gpu.max())
    return out


def with_workload(module: Module, workload: Workload) -> Module:
    return module if module.workload == workload else replace(module, workload=workload)
