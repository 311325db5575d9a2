"""What an FP8 generation hands vLLM (nereus.runtime.vllm_engine, no vLLM needed): a
block-FP8 checkpoint's names and tensors (codes under the HF name, block scales under
`weight_scale_inv`, fused q|k|v and gate|up split on block rows), its quantization_config,
and the refusals (a part that cuts a block; vLLM on CPU)."""

import json

import pytest
import torch

from nereus.ir.model import Model
from nereus.models import tensor_table
from nereus.models.fp8 import Fp8Weight
from nereus.models.quant import is_quantized
from nereus.runtime import fp8
from nereus.runtime.vllm_engine import save_hf_checkpoint, to_vllm_weights
from nereus.runtime.vllm_fp8 import FP8_CONFIG, fp8_hf_weights


def _weights(model):
    gen = torch.Generator().manual_seed(0)
    out = {}
    for spec in tensor_table(model):
        tensor = torch.randn(spec.shape, generator=gen).to(torch.bfloat16)
        if is_quantized(spec.name):
            codes, scales = fp8.quantize(tensor, 0, 0, 128)
            tensor = Fp8Weight(codes.view(torch.float8_e4m3fn), scales)
        out[spec.name] = tensor
    return out


def test_fp8_weights_are_split_into_a_block_fp8_checkpoint():
    # q = 256, k = v = 128, gate = up = 384 rows: every part a whole number of blocks
    model = Model("actor", "llama", 1, 256, 4, 2, 384, 64, "bf16")
    weights = _weights(model)
    named = dict(to_vllm_weights(weights, model))
    qkv = weights["layers.0.attn.qkv.weight"]
    assert torch.equal(named["model.layers.0.self_attn.k_proj.weight"].view(torch.uint8),
                       qkv.codes[256:384].view(torch.uint8))
    assert torch.equal(named["model.layers.0.self_attn.k_proj.weight_scale_inv"], qkv.scales[2:3])
    up = weights["layers.0.mlp.gate_up.weight"]
    assert torch.equal(named["model.layers.0.mlp.up_proj.weight_scale_inv"], up.scales[3:6])
    assert named["model.embed_tokens.weight"].dtype == torch.bfloat16  # not quantized
    assert not any(n.endswith("norm.weight_scale_inv") for n in named)


def test_a_part_that_cuts_a_block_is_refused():
    model = Model("actor", "llama", 1, 128, 4, 2, 192, 64, "bf16")  # q = 128, k = 64: k cuts block 1
    with pytest.raises(Exception, match="cut a 128-row FP8 block"):
        fp8_hf_weights(model, {f"actor/{k}": v for k, v in _weights(model).items()})


def test_the_checkpoint_declares_block_fp8(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    model = Model("actor", "llama", 1, 256, 4, 2, 384, 64, "bf16")
    path = save_hf_checkpoint(model, _weights(model), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == FP8_CONFIG
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)


@pytest.mark.parametrize("cuda, hidden, message", [(False, 256, "vLLM on CPU runs no block-FP8 weights"),
                                                   (True, 128, "k and v 64")])
def test_vllm_plans_with_fp8_are_refused_where_vllm_cannot_run_them(cuda, hidden, message):
    import nereus.ir as ir
    from nereus.rl.engine import check_vllm_plans

    source = open("examples/rl/ppo-vllm-cpu.nir").read()
    module = ir.parse_source(source)
    plan = module.plans[0]
    placement = plan.placement("actor.generation")
    from dataclasses import replace

    quantized = replace(placement, quant="fp8")
    plans = (replace(plan, placements=tuple(quantized if p is placement else p for p in plan.placements)),)
    actor = replace(module.model("actor"), hidden=hidden, heads=4, kv_heads=2)
    module = replace(module, plans=plans, models=tuple(actor if m.name == "actor" else m for m in module.models))
    with pytest.raises(ir.SemanticError, match=message):
        check_vllm_plans(module, cuda=cuda)
