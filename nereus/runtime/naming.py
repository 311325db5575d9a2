"""User parameter names ↔ Nereus tensors, declared once per architecture.

A Hugging Face llama checkpoint keeps q/k/v and gate/up as separate tensors; Nereus
fuses them (`layers.{i}.attn.qkv.weight` = q rows | k rows | v rows, `mlp.gate_up` =
gate rows | up rows, see nereus.models). Each HF name therefore maps to a global
Nereus tensor and a row range of it:

    model.layers.3.self_attn.k_proj.weight  →  actor/layers.3.attn.qkv.weight rows [q, q+kv)

Each family declares its names in its own file (`nereus/models/llama.py` HF_NAMES);
the converters live in nereus.models.hf (the single-process reference forward needs them
below the runtime) and are re-exported here, where the runtime API has always had them.
A critic's value head is HF's `score.weight` (LlamaForSequenceClassification with one
label).
"""

from __future__ import annotations

from nereus.models.hf import Target, hf_targets, hf_to_nereus, nereus_to_hf, parse_layer

__all__ = ["Target", "hf_targets", "hf_to_nereus", "nereus_to_hf", "parse_layer"]
