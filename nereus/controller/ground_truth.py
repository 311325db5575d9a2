"""Ground truth for the drift simulator: stage latencies composed from measured layer timings.

Input: a module, a workload, a model-stage and its `Layout`. Output: seconds (`predict`, the
same call signature as `CostModel.predict`, so the plan search can run under the truth).
Invariant: nothing here uses the cost model's formulas or coefficients (`cost_model.py`,
`calibrated.py`); the controllers never read this module's numbers, only noisy observations
of them, so a wrong structure in the cost model shows up as prediction error.

Per-layer seconds come from the measured H200 table (`nereus/controller/data/h200_layers.json`:
forward, forward+backward and CUDA-graph decode of llama layer stacks over batch, sequence,
context and tp ∈ {1, 2, 4, 8}), not from a roofline:
  forward / fwdbwd  a power law log t = a + b·log(tokens) + c·log(seq) fitted per (kind,
                    shape, tp) to the table's 6 points (b ≈ 1, c ≈ 0.05: the attention share)
  decode            bilinear interpolation of log t over the measured (log batch, log context)
                    grid, extrapolated along the edge segments (batch below the grid: flat)
A model shape the table lacks takes the nearest measured shape (by hidden size) scaled by the
ratio of per-GPU layer parameters; the lm_head is a layer's time scaled the same way.

Composition (each a different structure from the cost model's):
  pipeline      actual per-stage layer counts (Megatron's uneven split), the head on the last
                stage; a pass of m microbatches takes Σ_k s_k + (m − 1)·max_k s_k
  training      fwdbwd per layer, + one measured forward per layer under `recompute full`;
                TP: 4 ring all-reduces per layer and microbatch at 80% (intra) bus efficiency;
                DP: gradient all-reduce at 60% inter-node efficiency, 30% hidden under the
                backward; Adam: 30 bytes per parameter at 85% of HBM bandwidth. ZeRO 1: the
                same DP bytes (reduce-scatter, all-gather), Adam on the replica's 1/dp chunk;
                ZeRO 3: also the weights all-gathered for the forward, not hidden
  inference     forward per layer; offloaded weights stream in at 20 GB/s
  generation    w waves; prefill as a pass over the prompt; decode integrates the growing
                context with an 8-point midpoint rule, max(m, p) microbatch slots per token
  every stage   + 0.3 s (launch, synchronisation, logging)
"""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model, ModelStage, Module, Workload
from nereus.models import pp_layer_range

from .cost_model import Layout, workload_key
from .layer_model import LayerShape

# shipped with the package (package data), so `nereus simulate` works from any install
DEFAULT_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h200_layers.json")
EFFICIENCY_INTRA = 0.8
EFFICIENCY_INTER = 0.6
LATENCY_INTRA = 15e-6
LATENCY_INTER = 40e-6
DP_HIDDEN = 0.3  # share of the gradient all-reduce overlapped with the backward
ADAM_BYTES = 30
HBM_EFFICIENCY = 0.85
HOST_LINK = 20e9
STAGE_OVERHEAD_S = 0.3
QUADRATURE = 8


class GroundTruthError(NereusError):
    """The measured layer table is missing or cannot serve a query."""


def _interpolate(xs: tuple, ys, x: float, flat_below: bool) -> float:
    """Piecewise-linear y(x) through sorted xs, extended along the end segments (flat below
    the first point when `flat_below`)."""
    if x <= xs[0] and flat_below:
        return float(ys[0])
    i = min(max(bisect.bisect_left(xs, x) - 1, 0), len(xs) - 2)
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(ys[i] + slope * (x - xs[i]))


@dataclass(frozen=True)
class _Group:
    """The measured rows of one (kind, shape, tp), reduced to what the queries need."""

    kind: str
    params: float  # per-GPU layer parameters of the measured shape
    power: tuple = ()  # (a, b, c) of log t = a + b·log tokens + c·log seq (forward, fwdbwd)
    batches: tuple = ()  # decode grid, log batch
    contexts: tuple = ()  # decode grid, log context
    grid: tuple = ()  # decode log t per layer [batch][context]

    def seconds(self, batch: float, seq: float, context: float) -> float:
        if self.kind != "decode":
            a, b, c = self.power
            return math.exp(a + b * math.log(max(batch * seq, 1.0)) + c * math.log(max(seq, 1.0)))
        lb, lc = math.log(max(batch, 1e-9)), math.log(max(context, 1.0))
        column = [_interpolate(self.contexts, row, lc, False) for row in self.grid]
        return math.exp(_interpolate(self.batches, column, lb, True))


class LayerTable:
    """Per-layer seconds on one GPU from the measured table (see module docstring)."""

    def __init__(self, rows: list[dict]):
        groups: dict = {}
        for row in rows:
            groups.setdefault((row["kind"], row["shape"]), {}).setdefault(row["tp"], []).append(row)
        self.shapes: dict = {}  # shape name -> hidden
        self.groups: dict = {}  # (kind, shape, tp) -> _Group
        self._scaled: dict = {}  # (kind, model widths, tp) -> (_Group, scale)
        for (kind, shape), by_tp in groups.items():
            for tp, members in by_tp.items():
                first = members[0]
                self.shapes[shape] = first["hidden"]
                params = LayerShape(first["hidden"], first["heads"], first["kv_heads"], first["ffn"],
                                    first["head_dim"]).params
                per_layer = np.log([r["seconds"] / r["layers"] for r in members])
                if kind == "decode":
                    batches = sorted({r["batch"] for r in members})
                    contexts = sorted({r["context"] for r in members})
                    lookup = {(r["batch"], r["context"]): y for r, y in zip(members, per_layer)}
                    if len(lookup) != len(batches) * len(contexts) or len(batches) < 2 or len(contexts) < 2:
                        raise GroundTruthError(f"decode rows of {shape} tp {tp} do not form a grid",
                                               hint="measure every (batch, context) pair")
                    grid = tuple(tuple(float(lookup[(b, c)]) for c in contexts) for b in batches)
                    self.groups[(kind, shape, tp)] = _Group(kind, params, (), tuple(math.log(b) for b in batches),
                                                            tuple(math.log(c) for c in contexts), grid)
                else:
                    x = np.array([[1.0, math.log(r["batch"] * r["seq"]), math.log(r["seq"])] for r in members])
                    power = np.linalg.lstsq(x, per_layer, rcond=None)[0]
                    self.groups[(kind, shape, tp)] = _Group(kind, params, tuple(float(v) for v in power))

    @staticmethod
    def load(path: str = DEFAULT_TABLE) -> "LayerTable":
        return _load(os.path.abspath(path))

    def layer_seconds(self, kind: str, model: Model, tp: int, batch: float, seq: float, context: float) -> float:
        """Seconds of one layer of `model` at tensor parallelism `tp` on one GPU."""
        key = (kind, model.hidden, model.heads, model.kv_heads, model.ffn, tp)
        found = self._scaled.get(key)
        if found is None:
            found = self._scaled[key] = self._group_for(kind, model, tp)
        group, scale = found
        return group.seconds(batch, seq, context) * scale

    def _group_for(self, kind: str, model: Model, tp: int) -> tuple:
        """(the nearest measured group, per-GPU parameter ratio to scale its times by)."""
        shape = min(self.shapes, key=lambda s: abs(math.log(self.shapes[s] / model.hidden)))
        measured = sorted(t for k, s, t in self.groups if k == kind and s == shape)
        if not measured:
            raise GroundTruthError(f"no measured {kind} rows", hint="regenerate the layer table")
        near = min(measured, key=lambda t: abs(math.log(t / tp)))
        group = self.groups[(kind, shape, near)]
        params = LayerShape.of(model.hidden, model.heads, model.kv_heads, model.ffn, tp).params
        return group, params / group.params


@lru_cache(maxsize=4)
def _load(path: str) -> LayerTable:
    try:
        with open(path) as handle:
            return LayerTable(json.load(handle)["rows"])
    except (OSError, KeyError, json.JSONDecodeError) as error:
        raise GroundTruthError(f"{path}: cannot read the measured layer table: {error}",
                               hint="benchmarks/calibrate_layers.py writes it") from None


def _allreduce(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    if ranks <= 1:
        return 0.0
    return latency + 2.0 * (ranks - 1) / ranks * nbytes / bandwidth


class GroundTruth:
    """Hidden stage latencies of a simulated job (see module docstring). `predict` is cached."""

    def __init__(self, module: Module, table: LayerTable):
        self.module = module
        self.table = table
        self._cache: dict = {}

    def predict(self, workload: Workload, model_stage: ModelStage, layout: Layout) -> float:
        key = (model_stage, layout, workload_key(workload))
        value = self._cache.get(key)
        if value is None:
            if len(self._cache) > 500_000:
                self._cache.clear()
            value = self._stage(workload, model_stage, layout)
            self._cache[key] = value
        return value

    # -- composition ----------------------------------------------------------------------
    def _links(self, layout: Layout):
        cluster = self.module.cluster
        intra = (EFFICIENCY_INTRA * cluster.intra_bytes_per_s, LATENCY_INTRA)
        inter = (EFFICIENCY_INTER * cluster.inter_bytes_per_s / cluster.gpus_per_node, LATENCY_INTER)
        pp_link = intra if layout.tp * layout.pp <= cluster.gpus_per_node else inter
        dp_link = inter if layout.spans_nodes else intra
        return intra, pp_link, dp_link

    def _head(self, model: Model, tp: int, layer_s: float) -> float:
        """The lm_head as a layer's time scaled by parameters (a value head costs ~nothing)."""
        if model.head != "lm":
            return 0.0
        params = LayerShape.of(model.hidden, model.heads, model.kv_heads, model.ffn, tp).params
        return layer_s * (model.hidden * model.vocab / tp) / params

    def _pass(self, model: Model, layout: Layout, per_layer: float, comm_per_layer: float,
              micro: int, hop: float) -> float:
        """One pass of `micro` microbatches through the pipeline: Σ s_k + (m − 1)·max s_k."""
        stages = []
        for k in range(layout.pp):
            lo, hi = pp_layer_range(model.layers, layout.pp, k)
            s = (hi - lo) * (per_layer + comm_per_layer)
            if k == layout.pp - 1:
                s += self._head(model, layout.tp, per_layer)
            stages.append(s)
        return sum(stages) + (micro - 1) * max(stages) + (layout.pp - 1) * hop

    def _stage(self, workload: Workload, model_stage: ModelStage, layout: Layout) -> float:
        module = self.module
        model = module.model(model_stage.model)
        t, p, d = layout.tp, layout.pp, layout.dp
        h, nbytes = model.hidden, model.dtype_bytes
        (tp_bw, tp_lat), (pp_bw, pp_lat), (dp_bw, dp_lat) = self._links(layout)
        replica_batch = math.ceil(workload.batch / d)
        seq = workload.sequence
        stage = model_stage.stage
        layer = self.table.layer_seconds
        total = STAGE_OVERHEAD_S
        if stage in ("training", "inference"):
            micro = min(workload.microbatch, replica_batch)
            m = math.ceil(replica_batch / micro)
            kind = "fwdbwd" if stage == "training" else "forward"
            per_layer = layer(kind, model, t, micro, seq, seq)
            if stage == "training" and workload.recompute == "full":
                per_layer += layer("forward", model, t, micro, seq, seq)
            activation = micro * seq * h * nbytes
            comm = (4 if stage == "training" else 2) * _allreduce(activation, t, tp_bw, tp_lat)
            hop = pp_lat + activation / (t * pp_bw)
            total += self._pass(model, layout, per_layer, comm, m, hop * (2 if stage == "training" else 1))
            biggest = max(hi - lo for lo, hi in (pp_layer_range(model.layers, p, k) for k in range(p)))
            params = biggest * LayerShape.of(h, model.heads, model.kv_heads, model.ffn, t).params \
                + model.hidden * model.vocab / t
            if stage == "training":
                total += (1 - DP_HIDDEN) * _allreduce(nbytes * params, d, dp_bw, dp_lat)
                if layout.zero >= 3:  # half an all-reduce: one all-gather of the weights
                    total += 0.5 * _allreduce(nbytes * params, d, dp_bw, dp_lat)
                adam = ADAM_BYTES * params / (HBM_EFFICIENCY * module.cluster.gpu.hbm_bytes_per_s)
                total += adam / d if layout.zero else adam
            elif layout.offload:
                total += nbytes * params / HOST_LINK
            return total
        if stage != "generation":
            raise GroundTruthError(f"unknown stage {stage!r}")
        waves = max(1, layout.waves)
        wave_batch = math.ceil(replica_batch / waves)
        m = max(1, min(p, wave_batch))
        micro = wave_batch / m
        prompt, response = workload.prompt, workload.response
        prefill_layer = layer("forward", model, t, micro, prompt, prompt)
        prefill_comm = 2 * _allreduce(micro * prompt * h * nbytes, t, tp_bw, tp_lat)
        prefill = self._pass(model, layout, prefill_layer, prefill_comm, m, pp_lat)
        decode_comm = 2 * _allreduce(micro * h * nbytes, t, tp_bw, tp_lat)
        slowest = max(hi - lo for lo, hi in (pp_layer_range(model.layers, p, k) for k in range(p)))
        rounds = max(m, p)
        decode = 0.0
        for j in range(QUADRATURE):
            context = prompt + (j + 0.5) / QUADRATURE * response
            per_layer = layer("decode", model, t, micro, 1, context)
            token = slowest * (per_layer + decode_comm) + self._head(model, t, per_layer) + (pp_lat if p > 1 else 0)
            decode += rounds * token
        decode *= max(0, response - 1) / QUADRATURE
        return total + waves * (prefill + decode)
