"""HF parameter names ↔ Nereus fused tensors (single process, no distributed)."""

from __future__ import annotations

import pytest
import torch

from nereus.models import parameter_count
from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model
from nereus.runtime.naming import hf_targets, hf_to_nereus, nereus_to_hf

ACTOR = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=40)
CRITIC = Model("critic", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=40, head="value")


def _hf_state(model: Model) -> dict:
    gen = torch.Generator().manual_seed(1)
    return {name: torch.randn(t.shape, generator=gen) for name, t in hf_targets(model).items()}


@pytest.mark.parametrize("model", [ACTOR, CRITIC])
def test_every_parameter_maps_once_and_counts_match(model):
    targets = hf_targets(model)
    assert sum(torch.Size(t.shape).numel() for t in targets.values()) == parameter_count(model)
    assert ("score.weight" in targets) == (model.head == "value")
    assert ("lm_head.weight" in targets) == (model.head == "lm")


def test_qkv_rows_are_q_then_k_then_v():
    hf = _hf_state(ACTOR)
    full = hf_to_nereus(ACTOR, hf)
    qkv = full["actor/layers.1.attn.qkv.weight"]
    hd = ACTOR.hidden // ACTOR.heads
    q, kv = ACTOR.heads * hd, ACTOR.kv_heads * hd
    assert qkv.shape == (q + 2 * kv, ACTOR.hidden)
    assert torch.equal(qkv[:q], hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q:q + kv], hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(qkv[q + kv:], hf["model.layers.1.self_attn.v_proj.weight"])
    gate_up = full["actor/layers.0.mlp.gate_up.weight"]
    assert torch.equal(gate_up[ACTOR.ffn:], hf["model.layers.0.mlp.up_proj.weight"])


def test_round_trip():
    hf = _hf_state(CRITIC)
    back = nereus_to_hf(CRITIC, hf_to_nereus(CRITIC, hf))
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_missing_and_misshaped_parameters_are_reported():
    hf = _hf_state(ACTOR)
    del hf["model.norm.weight"]
    with pytest.raises(NereusError, match="missing \\['model.norm.weight'\\]"):
        hf_to_nereus(ACTOR, hf)
    hf = _hf_state(ACTOR)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    with pytest.raises(NereusError, match="k_proj.weight: shape \\(3, 32\\)"):
        hf_to_nereus(ACTOR, hf)
