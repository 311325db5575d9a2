"""A tensor-parallel llama whose weights are plain local tensors (the Nereus shards).

`weights` maps local names (`layers.0.attn.qkv.weight`, no `{model}/` prefix) to this TP
rank's local tensors laid out per the shard contract (nereus.rl.shards): qkv is
[q rows; k rows; v rows] of this rank (its bias the same rows), gate_up [gate rows; up
rows], o and down hold this rank's columns, embed and lm_head this rank's vocab rows.
Nothing is copied into modules, so whatever tensors the runtime holds are the ones that
compute, and after a transition the next call simply reads the new shards.

Architecture (Llama-2/3.x, and through their flags Qwen2/2.5 and Qwen3, whose family files
reuse this one): RMSNorm (eps `norm_eps`), rotary embeddings (`rope_theta`, optionally
Llama-3.1's `llama3` frequency scaling), GQA attention with `head_dim` per head, q/k/v
biases when `qkv_bias`, per-head RMSNorm of q and k before rotary when `qk_norm`, SwiGLU
MLP, a head tied to the embedding when `tie_embeddings`; `head value` gives a [1, hidden]
head. These follow transformers' LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Optional

from nereus.ir.model import Model, RopeScaling

from ._lazy import LazyModule
from .tensors import COLUMN, REPLICATED, ROW, VOCAB, FusedPart, TensorSpec

torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
parallel = LazyModule("nereus.models.parallel")
moe = LazyModule("nereus.models.qwen3_moe")  # the sparse MLP of a model with experts
if TYPE_CHECKING:
    from .expert_parallel import EpGroup
    from .parallel import TpGroup

Weights = dict  # local name -> torch.Tensor


# --- tensor table and sharding rules (read by the compiler: no torch here) ---

def layer_tensors(model: Model) -> tuple[TensorSpec, ...]:
    """One layer's tensors with `layers.{i}` as a pattern (see nereus.models.tensors)."""
    return _layer_pattern(model.hidden, model.heads, model.kv_heads, model.head_dim, model.ffn, model.dtype,
                          model.qkv_bias, model.qk_norm)


@lru_cache(maxsize=64)
def _layer_pattern(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, dtype: str,
                   qkv_bias: bool = False, qk_norm: bool = False) -> tuple[TensorSpec, ...]:
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_parts = (FusedPart("q", q, heads), FusedPart("k", kv, kv_heads), FusedPart("v", kv, kv_heads))
    attention = [TensorSpec("layers.{i}.attn.qkv.weight", (q + 2 * kv, hidden), dtype, COLUMN, None, qkv_parts)]
    if qkv_bias:  # a bias row per weight row: sharded exactly like the weight's rows
        attention.append(TensorSpec("layers.{i}.attn.qkv.bias", (q + 2 * kv,), dtype, COLUMN, None, qkv_parts))
    if qk_norm:  # one weight per head dimension, shared by all heads: every TP rank holds it whole
        attention += [TensorSpec("layers.{i}.attn.q_norm.weight", (head_dim,), dtype, REPLICATED, None),
                      TensorSpec("layers.{i}.attn.k_norm.weight", (head_dim,), dtype, REPLICATED, None)]
    return (
        TensorSpec("layers.{i}.input_norm.weight", (hidden,), dtype, REPLICATED, None),
        *attention,
        TensorSpec("layers.{i}.attn.o.weight", (hidden, q), dtype, ROW, None),
        TensorSpec("layers.{i}.post_attn_norm.weight", (hidden,), dtype, REPLICATED, None),
        TensorSpec(
            "layers.{i}.mlp.gate_up.weight",
            (2 * ffn, hidden),
            dtype,
            COLUMN,
            None,
            (FusedPart("gate", ffn, ffn), FusedPart("up", ffn, ffn)),
        ),
        TensorSpec("layers.{i}.mlp.down.weight", (hidden, ffn), dtype, ROW, None),
    )


def edge_tensors(model: Model) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(tensors before the first layer, tensors after the last layer). A tied lm head has
    no tensor of its own: it reads embed.weight (so tied models keep pp 1)."""
    first = (TensorSpec("embed.weight", (model.vocab, model.hidden), model.dtype, VOCAB, None, role="embed"),)
    if model.head == "value":
        head = (TensorSpec("value_head.weight", (1, model.hidden), model.dtype, REPLICATED, None, role="head"),)
    elif model.tie_embeddings:
        head = ()
    else:
        head = (TensorSpec("lm_head.weight", (model.vocab, model.hidden), model.dtype, VOCAB, None, role="head"),)
    last = (TensorSpec("final_norm.weight", (model.hidden,), model.dtype, REPLICATED, None, role="final_norm"),) + head
    return first, last


# Transformers' parameter names (the same for LlamaForCausalLM, Qwen2ForCausalLM and
# Qwen3ForCausalLM): (HF name pattern, Nereus local name pattern, fused part or None).
# Entries whose Nereus tensor a model lacks (biases, q/k norms, lm_head when tied) are
# skipped by nereus.models.hf.
HF_NAMES: tuple[tuple[str, str, Optional[str]], ...] = (
    ("model.embed_tokens.weight", "embed.weight", None),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_norm.weight", None),
    ("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attn.qkv.weight", "q"),
    ("model.layers.{i}.self_attn.k_proj.weight", "layers.{i}.attn.qkv.weight", "k"),
    ("model.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.qkv.weight", "v"),
    ("model.layers.{i}.self_attn.q_proj.bias", "layers.{i}.attn.qkv.bias", "q"),
    ("model.layers.{i}.self_attn.k_proj.bias", "layers.{i}.attn.qkv.bias", "k"),
    ("model.layers.{i}.self_attn.v_proj.bias", "layers.{i}.attn.qkv.bias", "v"),
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.weight", None),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.weight", None),
    ("model.layers.{i}.self_attn.o_proj.weight", "layers.{i}.attn.o.weight", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attn_norm.weight", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_up.weight", "gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.gate_up.weight", "up"),
    ("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down.weight", None),
    ("model.norm.weight", "final_norm.weight", None),
    ("lm_head.weight", "lm_head.weight", None),
    ("score.weight", "value_head.weight", None),
)


# --- forward (torch, through the lazy proxies above) ---



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
    """RMSNorm computed in fp32 and returned in x's dtype (as Megatron-LM and HF do for
    bf16: the mean of squares is where low precision hurts); a no-op cast for fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def inverse_frequencies(head_dim: int, theta: float = 10000.0, scaling: Optional[RopeScaling] = None,
                        device=None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in fp32, with Llama-3.1's `llama3`
    scaling when given (transformers' _compute_llama3_parameters): wavelengths above
    original/low_freq_factor are divided by `factor`, those below original/high_freq_factor
    kept, the band between interpolated smoothly."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return inv
    original = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotary(x: torch.Tensor, start, theta: float = 10000.0, scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """Rotate-half rotary embedding of x [B, heads, T, hd] at positions start..start+T-1,
    or, with `start` a [B, T] tensor, at each row's own positions (left-padded rows)."""
    hd = x.shape[-1]
    inv = inverse_frequencies(hd, theta, scaling, x.device)
    if isinstance(start, int):
        pos = torch.arange(start, start + x.shape[2], dtype=torch.float32, device=x.device)
        angles = torch.outer(pos, inv)
    else:  # [B, 1, T, hd/2]: broadcast over the heads
        angles = (start.to(torch.float32).unsqueeze(-1) * inv).unsqueeze(1)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    first, second = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def _causal_mask(t: int, start: int, device) -> Optional[torch.Tensor]:
    """Boolean [t, start + t] mask for t queries at positions start..start+t-1 over the
    cached keys and their own: query i sees keys 0..start+i. None where SDPA needs none:
    a single query sees every key, and a prefill (start 0) is plain is_causal."""
    if t == 1 or start == 0:
        return None
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(diagonal=start)


def padded_positions(pad: torch.Tensor, start: int, t: int) -> torch.Tensor:
    """[B, t] rotary positions of tokens start..start+t-1 of left-padded rows (`pad` [B]:
    each row's leading pad tokens): a row's first real token is position 0, as
    transformers' position_ids from an attention mask (pad tokens get 0)."""
    index = torch.arange(start, start + t, device=pad.device)
    return (index.unsqueeze(0) - pad.unsqueeze(1)).clamp_(min=0)


def padded_mask(pad: torch.Tensor, t: int, start: int) -> torch.Tensor:
    """Boolean [B, 1, t, start + t] attention mask of left-padded rows: query start+i sees
    the keys at or before it that are no pad tokens. A pad token's query sees itself as
    well (a row with no key at all would make SDPA's softmax NaN, and 0 * NaN is NaN in
    the real tokens' weighted sum too)."""
    keys = torch.arange(start + t, device=pad.device)
    queries = torch.arange(start, start + t, device=pad.device)
    causal = keys.unsqueeze(0) <= queries.unsqueeze(1)  # [t, S]
    real = keys.unsqueeze(0) >= pad.unsqueeze(1)  # [B, S]
    itself = keys.unsqueeze(0) == queries.unsqueeze(1)
    return ((causal.unsqueeze(0) & real.unsqueeze(1)) | itself.unsqueeze(0)).unsqueeze(1)


def _attention(x, w: Weights, i: int, shape: LocalShape, tp: TpGroup, cache: Optional[KvCache], start: int,
               model: Optional[Model] = None, pad: Optional[torch.Tensor] = None):
    """`start` is the position of x's first token: the cache length *before* this forward
    call, read once for all layers (layer i's cache has already grown when layer i+1 runs).
    `model` gives the numerics (rope, q/k norm, eps); None is the plain llama. `pad` [B]:
    leading pad tokens per row (left-padded prompts), masked out of attention and not
    counted in positions; None: no row is padded (the same arithmetic as before pads)."""
    b, t, _ = x.shape
    hd, nq, nkv = shape.head_dim, shape.heads, shape.kv_heads
    # this rank's bias rows match its weight rows; added inside the matmul as nn.Linear does
    # (a separate add rounds bf16 twice: 0.03 off transformers' Qwen2 logits)
    qkv = F.linear(parallel.copy_to_tp(x, tp), w[f"layers.{i}.attn.qkv.weight"], w.get(f"layers.{i}.attn.qkv.bias"))
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    q, k = q.view(b, t, nq, hd), k.view(b, t, nkv, hd)
    eps = model.norm_eps if model is not None else 1e-5
    if f"layers.{i}.attn.q_norm.weight" in w:  # Qwen3: RMSNorm over each head's dimensions
        # A replicated weight applied to this rank's heads only: copy_to_tp all-reduces
        # its gradient over the TP group, so every rank gets the whole (same) gradient.
        q = rms_norm(q, parallel.copy_to_tp(w[f"layers.{i}.attn.q_norm.weight"], tp), eps)
        k = rms_norm(k, parallel.copy_to_tp(w[f"layers.{i}.attn.k_norm.weight"], tp), eps)
    theta, scaling = (model.rope_theta, model.rope_scaling) if model is not None else (10000.0, None)
    positions = start if pad is None else padded_positions(pad, start, t)
    q = _rotary(q.transpose(1, 2), positions, theta, scaling)
    k = _rotary(k.transpose(1, 2), positions, theta, scaling)
    v = v.view(b, t, nkv, hd).transpose(1, 2)
    if cache is not None:
        if cache.keys[i] is not None:
            k = torch.cat([cache.keys[i], k], dim=2)
            v = torch.cat([cache.values[i], v], dim=2)
        cache.keys[i], cache.values[i] = k, v
    if nq != nkv:
        k = k.repeat_interleave(nq // nkv, dim=1)
        v = v.repeat_interleave(nq // nkv, dim=1)
    if pad is None:
        mask, causal = _causal_mask(t, start, x.device), start == 0 and t > 1
    else:
        mask, causal = padded_mask(pad, t, start), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out = out.transpose(1, 2).reshape(b, t, nq * hd)
    return parallel.reduce_from_tp(out @ w[f"layers.{i}.attn.o.weight"].t(), tp)


def _mlp(x, w: Weights, i: int, shape: LocalShape, tp: TpGroup):
    gate, up = (parallel.copy_to_tp(x, tp) @ w[f"layers.{i}.mlp.gate_up.weight"].t()).split(shape.ffn, dim=-1)
    return parallel.reduce_from_tp((F.silu(gate) * up) @ w[f"layers.{i}.mlp.down.weight"].t(), tp)


def embed(model: Model, w: Weights, tokens: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """[B, T] token ids → [B, T, hidden] (first pipeline stage)."""
    return parallel.vocab_parallel_embedding(tokens, w["embed.weight"], model.vocab, tp)


def run_layers(model: Model, w: Weights, x: torch.Tensor, layers: tuple[int, int], tp: TpGroup,
               cache: Optional[KvCache] = None, ep: Optional[EpGroup] = None,
               pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Transformer layers lo..hi-1 on the residual stream x [B, T, hidden]. A model with
    experts runs qwen3_moe.moe_mlp in place of the dense MLP, over the EP group `ep`
    (None: every expert on this rank). `pad` [B]: leading pad tokens of each row
    (`_attention`), None where no row is padded."""
    shape = LocalShape.of(model, tp.size)
    start = cache.length if cache is not None else 0
    eps = model.norm_eps
    for i in range(*layers):
        x = x + _attention(rms_norm(x, w[f"layers.{i}.input_norm.weight"], eps), w, i, shape, tp, cache, start, model,
                           pad)
        h = rms_norm(x, w[f"layers.{i}.post_attn_norm.weight"], eps)
        x = x + (moe.moe_mlp(model, w, i, h, tp, ep) if model.experts else _mlp(h, w, i, shape, tp))
    return x


def final_norm(w: Weights, x: torch.Tensor, model: Optional[Model] = None) -> torch.Tensor:
    """The last RMSNorm (eps of `model`; None: the plain llama's 1e-5)."""
    return rms_norm(x, w["final_norm.weight"], model.norm_eps if model is not None else 1e-5)


def hidden_states(model: Model, w: Weights, tokens: torch.Tensor, tp: TpGroup,
                  cache: Optional[KvCache] = None, ep: Optional[EpGroup] = None,
                  pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Final-normed hidden states [B, T, hidden] of `tokens` [B, T] (continuing `cache`),
    all layers on this rank (pp = 1); `pad` [B]: each row's leading pad tokens.

    Invariant: identical on every TP rank of the group (all partial sums are reduced)."""
    x = run_layers(model, w, embed(model, w, tokens, tp), (0, model.layers), tp, cache, ep, pad)
    return final_norm(w, x, model)


def local_logits(w: Weights, hidden: torch.Tensor, tp: TpGroup) -> torch.Tensor:
    """This rank's vocab columns of the logits [B, T, vocab/tp] (a tied head reads the
    embedding's rows, which are sharded like lm_head's)."""
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["embed.weight"]
    return parallel.copy_to_tp(hidden, tp) @ head.t()


def values(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Scalar head (critic / reward model): [B, T]."""
    return (hidden @ w["value_head.weight"].t()).squeeze(-1)


def init_full_weights(model: Model, generator: torch.Generator, dtype=None,
                      zero_value_head: bool = True) -> Weights:
    """Random full (unsharded) weights, GPT-2 style: normal(0, 0.02), output projections
    scaled by 1/sqrt(2·layers), norms 1; the value head is 0 when `zero_value_head` (a
    critic starts predicting 0) and random otherwise (a reward model with a spread)."""
    from .tensors import tensor_table

    dtype = torch.float32 if dtype is None else dtype
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
