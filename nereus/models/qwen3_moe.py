"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM; Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's
attention (per-head q/k RMSNorm, head_dim from the config) and, in place of the dense MLP,
a router over `experts` SwiGLU experts of width `expert_ffn`, of which each token uses
`experts_per_token` (weights renormalized to sum to 1 when `norm_topk_prob`). Every layer
is sparse (decoder_sparse_step 1, no mlp_only_layers, as published); there is no shared
expert.

Table: qwen3's attention and norms, then per layer (E = experts, F = expert_ffn)

    layers.{i}.mlp.router.weight                 [E, hidden]     replicated
    layers.{i}.mlp.experts.{e}.gate_up.weight    [2*F, hidden]   column, parts gate|up, expert e
    layers.{i}.mlp.experts.{e}.down.weight       [hidden, F]     row, expert e

for e in 0..E-1 (the expert index is written out in the pattern; only `{i}` is left).

Sharding rules (Megatron-LM's expert parallelism): attention, norms, router, embed and
head are sharded by TP exactly as in qwen3 and replicated on every EP rank; expert e is
held whole by EP rank e // (E / ep) only, and inside that rank split by TP as Megatron's
expert MLP (gate_up by column, part-wise; down by row). The layout pass applies this
through `TensorSpec.expert`.

HF names: the per-expert names of the published checkpoints and of transformers 4.x
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`, the router
`model.layers.{i}.mlp.gate.weight`). transformers 5 stacks them at load time into
`mlp.experts.gate_up_proj` [E, 2F, hidden] and `mlp.experts.down_proj` [E, hidden, F];
the element counts are the same.

Forward: llama's (qwen3's attention) with `moe_mlp` below in place of the dense MLP
(llama.run_layers calls it for a model with experts). As transformers'
Qwen3MoeSparseMoeBlock: router logits x·Wᵀ, softmax in fp32, top-k, renormalized when
`norm_topk_prob`, the weights cast back to the model dtype; each chosen expert computes
down(silu(gate x) * up x) and the results are summed weighted. With expert parallelism
(an EpGroup of size ep) every EP rank routes its own tokens, an all-to-all sends each
(token, choice) to the EP rank holding the expert (nereus.models.expert_parallel), that
rank runs its experts on their TP shards, reduces the partial sums over TP, and a
second all-to-all returns the results; the weighting and sum happen at the token's
source. TP inside an expert is Megatron's MLP: copy_to_tp before the column-parallel
gate_up, the TP all-reduce after the row-parallel down and before the routing weight
multiplies it, so the router's gradient sees whole expert outputs on every TP rank.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

from nereus.ir.model import Model

from ._lazy import LazyModule
from .llama import HF_NAMES as _DENSE_HF_NAMES
from .llama import _layer_pattern
from .llama import (  # noqa: F401  (the family's edges and forward are llama's, its MLP is moe_mlp)
    KvCache,
    LocalShape,
    edge_tensors,
    embed,
    final_norm,
    hidden_states,
    init_full_weights,
    local_logits,
    run_layers,
    values,
)
from .tensors import COLUMN, REPLICATED, ROW, FusedPart, TensorSpec

torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
parallel = LazyModule("nereus.models.parallel")
expert_parallel = LazyModule("nereus.models.expert_parallel")


def layer_tensors(model: Model) -> tuple[TensorSpec, ...]:
    """One layer's tensors with `layers.{i}` as a pattern (see nereus.models.tensors)."""
    return _moe_layer_pattern(model.hidden, model.heads, model.kv_heads, model.head_dim, model.dtype,
                              model.qk_norm, model.experts, model.expert_ffn)


@lru_cache(maxsize=64)
def _moe_layer_pattern(hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str, qk_norm: bool,
                       experts: int, expert_ffn: int) -> tuple[TensorSpec, ...]:
    # qwen3's attention block: llama's pattern up to (not including) its dense MLP
    dense = _layer_pattern(hidden, heads, kv_heads, head_dim, 1, dtype, False, qk_norm)
    attention = tuple(t for t in dense if ".mlp." not in t.name)
    parts = (FusedPart("gate", expert_ffn, expert_ffn), FusedPart("up", expert_ffn, expert_ffn))
    moe = [TensorSpec("layers.{i}.mlp.router.weight", (experts, hidden), dtype, REPLICATED, None)]
    for e in range(experts):
        moe.append(TensorSpec(f"layers.{{i}}.mlp.experts.{e}.gate_up.weight", (2 * expert_ffn, hidden), dtype, COLUMN,
                              None, parts, expert=e, experts=experts))
        moe.append(TensorSpec(f"layers.{{i}}.mlp.experts.{e}.down.weight", (hidden, expert_ffn), dtype, ROW, None,
                              expert=e, experts=experts))
    return attention + tuple(moe)


def hf_names(model: Model) -> tuple[tuple[str, str, Optional[str]], ...]:
    """(HF pattern, Nereus pattern, fused part) of `model`: qwen3's without the dense MLP,
    plus the router and every expert's projections (expert indices written out)."""
    names = [entry for entry in _DENSE_HF_NAMES if ".mlp." not in entry[0]]
    names.append(("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight", None))
    for e in range(model.experts):
        hf, local = f"model.layers.{{i}}.mlp.experts.{e}", f"layers.{{i}}.mlp.experts.{e}"
        names += [(f"{hf}.gate_proj.weight", f"{local}.gate_up.weight", "gate"),
                  (f"{hf}.up_proj.weight", f"{local}.gate_up.weight", "up"),
                  (f"{hf}.down_proj.weight", f"{local}.down.weight", None)]
    return tuple(names)


# --- forward (torch, through the lazy proxies above) ---

def moe_mlp(model: Model, w: dict, i: int, x, tp, ep=None):
    """Layer i's sparse MLP on x [B, T, hidden]: this rank's tokens routed to the experts of
    every EP rank of `ep` (None: one EP rank, every expert local). `w` holds the router
    whole and this EP rank's experts, TP-sharded (gate_up: gate rows | up rows of this TP
    rank; down: its columns). Returns [B, T, hidden], identical on the TP ranks."""
    ep = ep if ep is not None else expert_parallel.EpGroup()
    b, t, hidden = x.shape
    flat = x.reshape(-1, hidden)
    router_logits = flat @ w[f"layers.{i}.mlp.router.weight"].t()
    probs = torch.softmax(router_logits.float(), dim=-1)
    top, chosen = torch.topk(probs, model.experts_per_token, dim=-1)  # [N, k]
    if model.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(router_logits.dtype)
    per_rank = model.experts // ep.size
    token = torch.arange(flat.shape[0], device=x.device).repeat_interleave(model.experts_per_token)
    expert = chosen.reshape(-1)
    # the expert branch is column-parallel: its input's gradient is summed over TP
    rows, (received_expert,), how = expert_parallel.dispatch(parallel.copy_to_tp(flat, tp)[token],
                                                             expert // per_rank, ep, expert)
    # The all-to-alls are collectives, in the backward too: every EP rank must run each one.
    # rows[:0].sum() is an exact 0 that keeps `out` on the graph of the dispatch even when
    # none of this rank's experts got a token (or the ranks whose experts did wait forever)
    out = torch.zeros_like(rows) + rows[:0].sum()
    for e in range(ep.rank * per_rank, (ep.rank + 1) * per_rank):
        mine = (received_expert == e).nonzero().squeeze(-1)
        if mine.numel() == 0:
            continue
        gate_up = rows[mine] @ w[f"layers.{i}.mlp.experts.{e}.gate_up.weight"].t()
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        out = out.index_add(0, mine, (F.silu(gate) * up) @ w[f"layers.{i}.mlp.experts.{e}.down.weight"].t())
    if torch.is_grad_enabled() and not out.requires_grad:
        # the input does not need a gradient and no expert of this rank got a token: the
        # other EP ranks' combine still runs its backward all-to-all, so this one must too
        out = out.detach().requires_grad_()
    results = expert_parallel.combine(parallel.reduce_from_tp(out, tp), how, ep)
    weighted = results * top.reshape(-1, 1)
    return torch.zeros_like(flat).index_add(0, token, weighted).reshape(b, t, hidden)
