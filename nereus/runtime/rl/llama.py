"""A tensor-parallel llama whose weights are plain local tensors (the Nereus shards).

`weights` maps local names (`layers.0.attn.qkv.weight`, no `{model}/` prefix) to this TP
rank's local tensors laid out per the shard contract (nereus.runtime.rl.shards): qkv is
[q rows; k rows; v rows] of this rank, gate_up [gate rows; up rows], o and down hold this
rank's columns, embed and lm_head this rank's vocab rows. Nothing is copied into modules,
so whatever tensors the runtime holds are the ones that compute, and after a transition
the next call simply reads the new shards.

Architecture (Llama-2/3): RMSNorm (eps 1e-5), rotary embeddings (theta 10000), GQA
attention, SwiGLU MLP, untied embedding and head; `head value` gives a [1, hidden] head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from nereus.ir.model import Model

from .parallel import TpGroup, copy_to_tp, reduce_from_tp, vocab_parallel_embedding

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LocalShape:
    """Per-rank head counts of a model at a TP degree."""

    heads: int
    kv_heads: int
    head_dim: int
    ffn: int

    @staticmethod
    def of(model: Model, tp: int) -> "LocalShape":
        kv = model.kv_heads // tp if tp <= model.kv_heads else 1
        return LocalShape(model.heads // tp, kv, model.head_dim, model.ffn // tp)


@dataclass
class KvCache:
    """Per-layer keys and values [batch, local kv heads, tokens, head_dim], grown by decode."""

    keys: list[Optional[torch.Tensor]]
    values: list[Optional[torch.Tensor]]

    @staticmethod
    def empty(layers: int) -> "KvCache":
        return KvCache([None] * layers, [None] * layers)

    @property
    def length(self) -> int:
        """Tokens cached so far (by any layer this rank holds: PP stages hold some)."""
        return next((k.shape[2] for k in self.keys if k is not None), 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary(x: torch.Tensor, start: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half rotary embedding of x [B, heads, T, hd] at positions start..start+T-1."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    pos = torch.arange(start, start + x.shape[2], dtype=torch.float32, device=x.device)
    angles = torch.outer(pos, inv)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    first, second = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _attention(x, w: Weights, i: int, shape: LocalShape, tp: TpGroup, cache: Optional[KvCache], start: int):
    """`start` is the position of x's first token: the cache length *before* this forward
    call, read once for all layers (layer i's cache has already grown when layer i+1 runs)."""
    b, t, _ = x.shape
    hd, nq, nkv = shape.head_dim, shape.heads, shape.kv_heads
    qkv = copy_to_tp(x, tp) @ w[f"layers.{i}.attn.qkv.weight"].t()
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    q = _rotary(q.view(b, t, nq, hd).transpose(1, 2), start)
    k = _rotary(k.view(b, t, nkv, hd).transpose(1, 2), start)
    v = v.view(b, t, nkv, hd).transpose(1, 2)
    if cache is not None:
        if cache.keys[i] is not None:
            k = torch.cat([cache.keys[i], k], dim=2)
            v = torch.cat([cache.values[i], v], dim=2)
        cache.keys[i], cache.values[i] = k, v
    if nq != nkv:
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    # Prefill (start == 0) is causal; a decode step's queries see every cached key.
    out = F.scaled_dot_product_attention(q, k, v, is_causal=(start == 0 and t > 1))
    out = out.transpose(1, 2).reshape(b, t, nq * hd)
    return reduce_from_tp(out @ w[f"layers.{i}.attn.o.weight"].t(), tp)


def _mlp(x, w: Weights, i: int, shape: LocalShape, tp: TpGroup):
    gate, up = (copy_to_tp(x, tp) @ w[f"layers.{i}.mlp.gate_up.weight"].t()).split(shape.ffn, dim=-1)
    return reduce_from_tp((F.silu(gate) * up) @ w[f"layers.{i}.mlp.down.weight"].t(), tp)


def embed(model: Model, w: Weights, tokens: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """[B, T] token ids → [B, T, hidden] (first pipeline stage)."""
    return vocab_parallel_embedding(tokens, w["embed.weight"], model.vocab, tp)


def run_layers(model: Model, w: Weights, x: torch.Tensor, layers: tuple[int, int], tp: TpGroup,
               cache: Optional[KvCache] = None) -> torch.Tensor:
    """Transformer layers lo..hi-1 on the residual stream x [B, T, hidden]."""
    shape = LocalShape.of(model, tp.size)
    start = cache.length if cache is not None else 0
    for i in range(*layers):
        x = x + _attention(rms_norm(x, w[f"layers.{i}.input_norm.weight"]), w, i, shape, tp, cache, start)
        x = x + _mlp(rms_norm(x, w[f"layers.{i}.post_attn_norm.weight"]), w, i, shape, tp)
    return x


def final_norm(w: Weights, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w["final_norm.weight"])


def hidden_states(model: Model, w: Weights, tokens: torch.Tensor, tp: TpGroup,
                  cache: Optional[KvCache] = None) -> torch.Tensor:
    """Final-normed hidden states [B, T, hidden] of `tokens` [B, T] (continuing `cache`),
    all layers on this rank (pp = 1).

    Invariant: identical on every TP rank of the group (all partial sums are reduced)."""
    x = run_layers(model, w, embed(model, w, tokens, tp), (0, model.layers), tp, cache)
    return final_norm(w, x)


def local_logits(w: Weights, hidden: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """This rank's vocab columns of the logits [B, T, vocab/tp]."""
    return copy_to_tp(hidden, tp) @ w["lm_head.weight"].t()


def values(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Scalar head (critic / reward model): [B, T]."""
    return (hidden @ w["value_head.weight"].t()).squeeze(-1)


def init_full_weights(model: Model, generator: torch.Generator, dtype=torch.float32,
                      zero_value_head: bool = True) -> Weights:
    """Random full (unsharded) weights, GPT-2 style: normal(0, 0.02), output projections
    scaled by 1/sqrt(2·layers), norms 1; the value head is 0 when `zero_value_head` (a
    critic starts predicting 0) and random otherwise (a reward model with a spread)."""
    from nereus.ir.architecture import tensor_table

    out: Weights = {}
    for spec in tensor_table(model):
        if spec.name.endswith("norm.weight"):
            out[spec.name] = torch.ones(spec.shape, dtype=dtype)
        elif spec.name == "value_head.weight" and zero_value_head:
            out[spec.name] = torch.zeros(spec.shape, dtype=dtype)
        else:
            std = 0.02 / (2 * model.layers) ** 0.5 if spec.name.endswith(("o.weight", "down.weight")) else 0.02
            out[spec.name] = (torch.randn(spec.shape, generator=generator) * std).to(dtype)
    return out
