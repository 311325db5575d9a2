"""Qwen2 / Qwen2.5 (transformers' Qwen2ForCausalLM, dense): the llama architecture with a
bias on the q, k and v projections (none on o_proj or the MLP), RMSNorm eps and rope
theta from the config (1e-6 and 1,000,000 for Qwen2.5), untied head from 7B up and tied
below. A plain `= qwen2 { ... }` declaration has `qkv_bias true`.

Table: llama's plus, per layer,

    layers.{i}.attn.qkv.bias   [(heads+2*kv_heads)*hd]   column, parts q|k|v

sharded with the same parts as its weight, so a TP rank's bias rows are exactly its
weight rows (q rows split by heads; a KV head's rows replicated on tp/kv_heads ranks when
tp > kv_heads). Forward: llama's, which adds the bias where the table has one.
HF names: transformers' Qwen2 names equal Llama's (`self_attn.q_proj.bias`, ...).
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
