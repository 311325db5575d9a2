"""Qwen3 (transformers' Qwen3ForCausalLM, dense): the llama architecture with an RMSNorm
over each query and key head (before rotary), a head_dim written in the config rather
than hidden / heads (128 for every size), no q/k/v bias, eps 1e-6 and rope theta
1,000,000. A plain `= qwen3 { ... }` declaration has `qk_norm true`.

Table: llama's plus, per layer,

    layers.{i}.attn.q_norm.weight   [head_dim]   replicated
    layers.{i}.attn.k_norm.weight   [head_dim]   replicated

one weight shared by all heads, so every TP rank holds it whole whatever tp is. q and
o hold heads * head_dim rows / columns, which may differ from hidden (Qwen3-0.6B: 16
heads of 128 in a hidden of 1024). Forward: llama's, which normalizes q and k where the
table has their norms. HF names: `self_attn.q_norm.weight`, `self_attn.k_norm.weight`,
the rest as Llama's.
"""

from .llama import (  # noqa: F401  (the family's table, names and forward)
    HF_NAMES,
    KvCache,
    LocalShape,
    edge_tensors,
    embed,
    final_norm,
    hidden_states,
    init_full_weights,
    layer_tensors,
    local_logits,
    run_layers,
    values,
)
