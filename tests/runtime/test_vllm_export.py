"""The checkpoint the vLLM path starts its engines from (nereus.runtime.vllm_engine's
save_hf_checkpoint / hf_config) is the model's own family with its numerics: written from
the weights of a tiny transformers checkpoint, it holds the same bytes, transformers
computes the same logits from it as the reference, and `hf("dir")` reads back the same
model (eps, rope theta and llama3 scaling, head_dim, tying, bias, q/k norm). vLLM itself
is not imported (its own tests, tests/vllm, run where it is installed)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import nereus.ir as ir
from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.models import logits
from nereus.models.hf import hf_to_nereus
from nereus.runtime.vllm_engine import hf_checkpoint_weights, hf_config, save_hf_checkpoint, to_vllm_weights

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from hf_tiny import TINY, nir, write_checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _read(tmp_path: Path, checkpoint: str) -> ir.Model:
    plan = tmp_path / f"{checkpoint}.nir"
    plan.write_text(nir(checkpoint))
    return ir.parse_file(plan).model("actor")


def _numerics(model: ir.Model) -> dict:
    skip = {"name", "base", "checkpoint", "checkpoint_dir", "checkpoint_fields", "loc", "key_locs"}
    return {f.name: getattr(model, f.name) for f in fields(model) if f.name not in skip}


@pytest.mark.parametrize("name", sorted(TINY))
def test_export_is_the_family_checkpoint(tmp_path, name):
    original = write_checkpoint(name, tmp_path / "source")
    model = _read(tmp_path, "source")
    files = safetensors_torch.load_file(str(tmp_path / "source" / "model.safetensors"))
    weights = hf_to_nereus(model, files)  # whole tensors by global Nereus name, as the sync delivers them
    save_hf_checkpoint(model, weights, tmp_path / "engine", max_position_embeddings=256)

    written = safetensors_torch.load_file(str(tmp_path / "engine" / "model.safetensors"))
    if model.tie_embeddings:
        files.pop("lm_head.weight", None)
    assert set(written) == set(files)
    assert all(torch.equal(written[k].view(torch.uint8), files[k].view(torch.uint8)) for k in files)

    back = _read(tmp_path, "engine")
    assert _numerics(back) == _numerics(model)
    config = json.loads((tmp_path / "engine" / "config.json").read_text())
    assert config["architectures"] == [type(original).__name__]

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "engine").eval()
    ids = torch.randint(0, model.vocab, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, theirs = logits(model, files, ids), exported(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_local_names_and_completeness(tmp_path):
    write_checkpoint("qwen2", tmp_path / "source")
    model = _read(tmp_path, "source")
    files = safetensors_torch.load_file(str(tmp_path / "source" / "model.safetensors"))
    local = {k.split("/", 1)[1]: v for k, v in hf_to_nereus(model, files).items()}
    assert set(hf_checkpoint_weights(model, local)) == set(files)
    with pytest.raises(NereusError, match="missing"):
        hf_checkpoint_weights(model, {k: v for k, v in local.items() if k != "final_norm.weight"})
    # the engine's reload path: Qwen weights under the checkpoint's names and values, no copies
    pushed = dict(to_vllm_weights(local, model))
    assert set(pushed) == set(files) and all(torch.equal(pushed[k], files[k]) for k in files)
    assert pushed["model.layers.0.self_attn.k_proj.bias"].data_ptr() == (
        local["layers.0.attn.qkv.bias"][model.heads * model.head_dim:].data_ptr())
    with pytest.raises(NereusError, match="no vLLM parameter"):  # llama: fused names, lm weights only
        to_vllm_weights({"layers.0.attn.qkv.bias": local["layers.0.attn.qkv.bias"]})


def test_what_no_hf_class_computes_is_refused():
    sizes = dict(layers=1, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=96)
    with pytest.raises(SemanticError, match="lm head"):
        hf_config(ir.Model("critic", "llama", head="value", **sizes))
    with pytest.raises(SemanticError, match="q/k/v bias"):
        hf_config(ir.Model("actor", "llama", qkv_bias=True, **sizes))
    with pytest.raises(SemanticError, match="q/k norm"):
        hf_config(ir.Model("actor", "qwen3", **sizes))
