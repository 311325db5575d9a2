"""config.json edge cases read as transformers 5 reads them, each checked by comparing
Nereus' logits with transformers' on a tiny checkpoint whose config.json was edited after
save_pretrained: rope_parameters beside a top-level rope_theta / rope_scaling (merged as
transformers merges them), a tied config whose file holds another lm_head.weight (refused),
Qwen2's q/k/v bias in bf16 (one rounding, as nn.Linear), and the per-family defaults of a
missing head_dim / num_key_value_heads."""

from __future__ import annotations

import json

import pytest
import torch

import nereus.ir as ir
from nereus.models import family
from nereus.models.hf import hf_to_nereus
from nereus.models.parallel import TpGroup

from hf_tiny import nir, transformers, write_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


def _edit_config(directory, **changes) -> dict:
    """config.json with `changes` applied (a value None deletes the key)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return config


def _nereus_logits(tmp_path, directory, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Nereus' forward (the family's own, tp 1) at `dtype` on the checkpoint's tensors."""
    (tmp_path / "plan.nir").write_text(nir(directory.name))
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    state = safetensors_torch.load_file(directory / "model.safetensors")
    prefix = f"{model.name}/"
    weights = {name[len(prefix):]: t.to(dtype) for name, t in hf_to_nereus(model, state).items()}
    forward = family(model)
    with torch.no_grad():
        hidden = forward.hidden_states(model, weights, ids, TpGroup())
        return forward.local_logits(weights, hidden, TpGroup())


def _transformers_logits(directory, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits


def _ids(vocab: int, tokens: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(3))


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope", [
    # both spellings: transformers takes rope_scaling whole (rope_parameters' theta is lost)
    # and fills its theta from the top-level rope_theta
    dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_scaling=LLAMA3, rope_theta=10000.0),
    # rope_parameters without a theta takes the top-level one
    dict(rope_parameters={"rope_type": "default"}, rope_theta=31.0, rope_scaling=None),
    # rope_parameters' own theta wins over the top-level one
    dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rope_theta=10.0, rope_scaling=None),
    # llama3 scaling without original_max_position_embeddings: max_position_embeddings
    dict(rope_parameters={**{k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"},
                          "rope_theta": 1000.0}, max_position_embeddings=32, rope_scaling=None),
])
def test_rope_parameters_beside_top_level_rope_keys_read_as_transformers(tmp_path, rope):
    write_checkpoint("llama31", tmp_path / "ckpt")
    _edit_config(tmp_path / "ckpt", rope_parameters=None, rope_scaling=None, rope_theta=None)
    _edit_config(tmp_path / "ckpt", **rope)
    ids = _ids(96)
    expected = _transformers_logits(tmp_path / "ckpt", ids)
    assert (_nereus_logits(tmp_path, tmp_path / "ckpt", ids) - expected).abs().max().item() < 1e-4


def test_qwen2_qkv_bias_in_bf16_is_rounded_once_as_transformers(tmp_path):
    """x @ W.t() + b rounds the bf16 product, then the sum (0.03 off transformers' logits,
    whose nn.Linear adds the bias inside the matmul); every other weight already matched."""
    write_checkpoint("qwen2", tmp_path / "ckpt", dtype=torch.bfloat16)
    ids = _ids(96)
    expected = _transformers_logits(tmp_path / "ckpt", ids, torch.bfloat16)
    ours = _nereus_logits(tmp_path, tmp_path / "ckpt", ids, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected), (ours - expected).abs().max()


@pytest.mark.parametrize("name, sizes, left_out", [
    # Qwen2Config and Qwen3Config default num_key_value_heads to 32, Qwen3MoeConfig to 4:
    # not to the attention heads, as LlamaConfig does
    ("qwen2", dict(hidden_size=128, num_attention_heads=64, num_key_value_heads=32), "num_key_value_heads"),
    ("qwen3", dict(hidden_size=128, num_attention_heads=64, num_key_value_heads=32, head_dim=2),
     "num_key_value_heads"),
    ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=4), "num_key_value_heads"),
    # Qwen3Config defaults head_dim to 128, not to hidden / heads
    ("qwen3", dict(head_dim=128), "head_dim"),
])
def test_missing_head_counts_and_sizes_take_transformers_defaults(tmp_path, name, sizes, left_out):
    """The checkpoint is written with the family's default, then the key left out of
    config.json (Nereus read the attention heads, and hidden / heads)."""
    hf_model = write_checkpoint(name, tmp_path / "ckpt", sizes=sizes)
    _edit_config(tmp_path / "ckpt", **{left_out: None})
    ids = _ids(hf_model.config.vocab_size, 12)
    expected = _transformers_logits(tmp_path / "ckpt", ids)
    assert (_nereus_logits(tmp_path, tmp_path / "ckpt", ids) - expected).abs().max().item() < 1e-4


def _tied_with_its_own_head(tmp_path, same: bool):
    """A tied Llama-3.2-like checkpoint whose file also holds lm_head.weight: the embedding
    again (`same`) or another tensor."""
    write_checkpoint("llama32_tied", tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "model.safetensors"
    state = safetensors_torch.load_file(path)
    embedding = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embedding.clone() if same else torch.randn_like(embedding)
    safetensors_torch.save_file(state, path, metadata={"format": "pt"})
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    return ir.parse_file(tmp_path / "plan.nir").model("actor"), state


def test_a_tied_config_whose_file_holds_another_head_is_refused(tmp_path):
    """transformers unties such a model and computes with the file's lm_head.weight;
    Nereus used the embedding, silently. Refused by the checkpoint check `nereusc check`
    and `nereus train` run, by the runtime's loader and by the reference forward."""
    from nereus.cli.check import check_checkpoints
    from nereus.runtime.hf_checkpoint import shard_checkpoint
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime.state import unit_on_gpu

    model, state = _tied_with_its_own_head(tmp_path, same=False)
    module = ir.parse_file(tmp_path / "plan.nir")
    message = "holds lm_head.weight, which differs from model.embed_tokens.weight"
    with pytest.raises(ir.SemanticError, match=message) as error:
        check_checkpoints(module)
    assert "transformers computes with lm_head.weight" in str(error.value)
    assert "tie_word_embeddings" in error.value.hint
    with pytest.raises(ir.NereusError, match=message):
        shard_checkpoint(model, ir.ModelStage("actor", "inference"),
                         unit_on_gpu(plan_units_json(module, "A", "actor.inference"), 0), 0, str(tmp_path / "ckpt"))
    from nereus.models import logits

    with pytest.raises(ir.NereusError, match=message):
        logits(model, state, _ids(96))


def test_a_tied_config_whose_file_holds_the_embedding_twice_matches_transformers(tmp_path):
    from nereus.cli.check import check_checkpoints

    model, _ = _tied_with_its_own_head(tmp_path, same=True)
    assert check_checkpoints(ir.parse_file(tmp_path / "plan.nir")) == []
    ids = _ids(96)
    expected = _transformers_logits(tmp_path / "ckpt", ids)
    assert (_nereus_logits(tmp_path, tmp_path / "ckpt", ids) - expected).abs().max().item() < 1e-4
