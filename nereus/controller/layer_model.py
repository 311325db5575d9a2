"""Roofline features of one llama layer on one GPU, fitted to measured layer latencies.

The time of one transformer layer on one GPU of a TP group (heads, kv heads and ffn divided
by tp; hidden whole, as in Megatron-LM) is written as Σ_j θ_j·f_j with features in seconds
at nominal peak rates (F = peak FLOP/s, W = HBM bytes/s of the cluster's GPU):

  P       = per-GPU layer parameters = h·(a_t + 2·k_t)·d + a_t·d·h + 3·f_t·h + 2h
  dense   = 2·P·tokens / F                     (Narayanan et al. SC'21: 2 FLOP/param/token)
  weights = 2·P / W   (+ KV bytes 4·B·c·k_t·d / W when decoding: the cache is read once)
  f_roof  = max(dense, bytes), f_over = min(dense, bytes)      roofline (Williams et al.
            2009): a well-overlapped kernel costs the max; θ_over measures how much of the
            smaller side is not hidden
  f_attn  = attention score/value FLOPs / F: 2·tokens·s·a_t·d for causal prefill over s
            tokens (mean context s/2), 4·B·c·a_t·d for a decode step over context c
  f_act   = tokens·(h + f_t)·2 / W             elementwise traffic (norms, SwiGLU, residuals)
  f_fixed = 10 µs                              kernel launches and small-kernel tails

with a_t = heads/t, k_t = max(1, kv_heads/t), f_t = ffn/t, d = head_dim. Forward,
forward+backward and decode each have their own θ ("fit per stage type"), fitted
by non-negative least squares on relative error (`nnls.fit_relative`) to the table that
`benchmarks/calibrate_layers.py` measured on an H200 (`nereus/controller/data/h200_layers.json`).
The fit's held-out error is reported by `benchmarks/controller_fit_layers.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .nnls import fit_relative, relative_errors

KINDS = ("forward", "fwdbwd", "decode")
FEATURES = ("roof", "over", "attn", "act", "fixed")
FIXED_SECONDS = 1e-5


@dataclass(frozen=True)
class LayerShape:
    """One GPU's share of a llama layer under tensor parallelism."""

    hidden: int
    heads: int  # per GPU
    kv_heads: int  # per GPU (≥ 1: replicated when tp > kv_heads)
    ffn: int  # per GPU
    head_dim: int

    @property
    def params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * self.ffn * h + 2 * h

    @staticmethod
    def of(hidden: int, heads: int, kv_heads: int, ffn: int, tp: int) -> "LayerShape":
        """The per-GPU share of a layer of the given full widths at tensor parallelism tp."""
        return LayerShape(hidden, heads // tp, max(1, kv_heads // tp), ffn // tp, hidden // heads)


def layer_features(kind: str, shape: LayerShape, batch: float, seq: float, context: float,
                   flops: float, hbm: float, dtype_bytes: int = 2) -> np.ndarray:
    """Feature vector (FEATURES order, seconds at θ = 1) of one layer on one GPU.

    kind "forward"/"fwdbwd": `batch` sequences of `seq` tokens, causal attention.
    kind "decode": one new token for each of `batch` sequences over `context` cached tokens.
    """
    h, d = shape.hidden, shape.head_dim
    params = shape.params
    if kind == "decode":
        tokens = batch
        attn_flops = 4.0 * batch * context * shape.heads * d
        moved = dtype_bytes * params + 2.0 * dtype_bytes * batch * context * shape.kv_heads * d
    else:
        tokens = batch * seq
        attn_flops = 2.0 * tokens * seq * shape.heads * d
        moved = dtype_bytes * params
    dense = 2.0 * params * tokens / flops
    memory = moved / hbm
    act = tokens * (h + shape.ffn) * dtype_bytes / hbm
    return np.array([max(dense, memory), min(dense, memory), attn_flops / flops, act, FIXED_SECONDS])


def row_features(row: dict, flops: float, hbm: float) -> np.ndarray:
    """Features of one measured row of the calibration table (its whole stack of layers)."""
    shape = LayerShape(row["hidden"], row["heads"], row["kv_heads"], row["ffn"], row["head_dim"])
    return row["layers"] * layer_features(row["kind"], shape, row["batch"], row["seq"], row["context"], flops, hbm)


@dataclass(frozen=True)
class LayerFit:
    """Fitted θ per kind and the relative errors of the rows they were checked on."""

    theta: dict  # kind -> tuple of floats (FEATURES order)
    train_mape: dict  # kind -> mean |relative error| on the fitting rows
    heldout_mape: dict  # kind -> mean |relative error| on held-out rows (NaN if none)


def fit_layer_table(rows: list[dict], flops: float, hbm: float, heldout: list[dict] = ()) -> LayerFit:
    """Fit θ ≥ 0 per kind on `rows` (relative error, no prior pull) and score `heldout`.

    Input: rows as written by benchmarks/calibrate_layers.py. Output: LayerFit.
    """
    theta, train, test = {}, {}, {}
    for kind in KINDS:
        fit_rows = [r for r in rows if r["kind"] == kind]
        if not fit_rows:
            continue
        x = np.array([row_features(r, flops, hbm) for r in fit_rows])
        y = np.array([r["seconds"] for r in fit_rows])
        coefficients = fit_relative(x, y, np.zeros(len(FEATURES)), prior_weight=1e-9)
        theta[kind] = tuple(float(c) for c in coefficients)
        train[kind] = float(np.mean(np.abs(relative_errors(x, y, coefficients))))
        held = [r for r in heldout if r["kind"] == kind]
        if held:
            hx = np.array([row_features(r, flops, hbm) for r in held])
            hy = np.array([r["seconds"] for r in held])
            test[kind] = float(np.mean(np.abs(relative_errors(hx, hy, coefficients))))
        else:
            test[kind] = float("nan")
    return LayerFit(theta, train, test)
