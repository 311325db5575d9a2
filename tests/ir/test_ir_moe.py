"""Mixture-of-experts keys and the `ep` placement key: values from `hf(...)`, printing and
round trips, and the rules as located errors."""

import json
import shutil
from pathlib import Path

import pytest

import nereus.ir as ir

DATA = Path(__file__).parents[1] / "data" / "hf"
CLUSTER = ("cluster c { nodes 2 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s "
           "inter 25GB/s host_mem 2TB }\n")
MOE = "model actor = qwen3_moe { layers 4 hidden 256 heads 4 kv_heads 2 ffn 512 vocab 1024 " \
      "experts 8 experts_per_token 2 expert_ffn 64 }"


def _module(models: str = MOE, placements: str = "actor.training dp 1 ep 4 tp 2 on 0..7") -> str:
    return (CLUSTER + models + "\nworkload w { batch 8 prompt 16 response 16 microbatch 1 training: actor }\n"
            f"plan A {{ {placements} }}\n")


def _error(text: str) -> str:
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(text, "t.nir")
    return caught.value.format()


def test_hand_written_moe_model_and_ep_placement():
    module = ir.parse_source(_module())
    actor = module.model("actor")
    assert (actor.experts, actor.experts_per_token, actor.expert_ffn, actor.norm_topk_prob, actor.qk_norm) == \
        (8, 2, 64, True, True)
    placement = module.plan("A").placement("actor.training")
    assert (placement.dp, placement.tp, placement.pp, placement.ep, placement.world) == (1, 2, 1, 4, 8)
    # mesh order: EP rank outside TP rank inside a pipeline stage
    assert placement.gpu_of(0, 0, 1 * 2 + 1) == 3


def test_moe_round_trip_prints_ep_and_expert_keys():
    module = ir.parse_source(_module(placements="actor.training dp 2 pp 2 ep 4 on 0..15"))
    text = ir.print_module(module)
    assert "experts 8" in text and "expert_ffn 64" in text and "ep 4" in text
    assert "norm_topk_prob" not in text  # the family default
    assert ir.parse_source(text) == module


def test_hf_qwen3_moe_config(tmp_path):
    shutil.copytree(DATA / "qwen3-30b-a3b", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(_module('model actor = hf("ckpt")', "actor.training dp 1 ep 16 on 0..15"))
    module = ir.parse_file(tmp_path / "plan.nir")
    actor = module.model("actor")
    assert (actor.architecture, actor.layers, actor.hidden, actor.heads, actor.kv_heads, actor.head_dim) == \
        ("qwen3_moe", 48, 2048, 32, 4, 128)
    assert (actor.experts, actor.experts_per_token, actor.expert_ffn, actor.norm_topk_prob, actor.qk_norm) == \
        (128, 8, 768, True, True)
    assert ir.parse_source(ir.print_module(module), str(tmp_path / "plan.nir")) == module


@pytest.mark.parametrize("field, value, message", [
    ("decoder_sparse_step", 2, "decoder_sparse_step 2 is not supported"),
    ("mlp_only_layers", [0], "mlp_only_layers [0] is not supported"),
    ("num_experts", 0, "'num_experts' must be a positive integer"),
])
def test_hf_moe_config_errors(tmp_path, field, value, message):
    config = json.loads((DATA / "qwen3-30b-a3b" / "config.json").read_text())
    config[field] = value
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "plan.nir").write_text(_module('model actor = hf("ckpt")', "actor.training dp 1 on 0"))
    with pytest.raises(ir.SemanticError) as caught:
        ir.parse_file(tmp_path / "plan.nir")
    assert message in caught.value.message
    assert caught.value.loc.line == 2


def test_ep_must_divide_experts():
    text = _error(_module(placements="actor.training dp 1 ep 3 on 0..2"))
    assert "t.nir:4:33: error: ep 3 must divide experts (8) of actor" in text
    assert "ep values that fit: 1, 2, 4, 8" in text


def test_ep_needs_a_moe_model():
    dense = "model actor = qwen3 { layers 4 hidden 256 heads 4 kv_heads 2 ffn 512 vocab 1024 }"
    text = _error(_module(dense, "actor.training dp 1 ep 2 on 0..1"))
    assert "t.nir:4:33: error: ep 2 needs a mixture-of-experts model; actor is a dense qwen3" in text


def test_dense_model_rejects_expert_keys():
    dense = "model actor = llama { layers 4 hidden 256 heads 4 kv_heads 2 ffn 512 vocab 1024 experts 8 }"
    text = _error(_module(dense, "actor.training dp 1 on 0"))
    assert "error: experts is for mixture-of-experts models; actor is a dense llama" in text
    assert "t.nir:2:" in text


def test_experts_per_token_at_most_experts():
    text = _error(_module(MOE.replace("experts_per_token 2", "experts_per_token 9")))
    assert "error: experts_per_token 9 is more than the 8 experts of actor" in text


def test_moe_needs_expert_keys():
    text = _error(_module(MOE.replace(" expert_ffn 64", "")))
    assert "expert_ffn must be at least 1, found 0" in text


def test_tp_must_divide_expert_ffn():
    text = _error(_module(MOE.replace("expert_ffn 64", "expert_ffn 62"), "actor.training dp 1 tp 4 on 0..3"))
    assert "tp 4 must divide expert_ffn (62) of actor" in text


def test_gpu_count_names_ep():
    text = _error(_module(placements="actor.training dp 1 ep 4 tp 2 on 0..3"))
    assert "but dp x tp x pp x ep = 1 x 2 x 1 x 4 = 8" in text


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_ep_is_refused_at_the_zero_key(zero):
    text = _error(_module(placements=f"actor.training dp 2 ep 4 zero {zero} on 0..7"))
    assert text == "\n".join([
        "t.nir:4:40: error: zero with expert parallelism is not supported yet",
        f"    4 | plan A {{ actor.training dp 2 ep 4 zero {zero} on 0..7 }}",
        "      |                                        ^",
        f"hint: use zero 0 with ep 4, or ep 1 with zero {zero}"])


def test_zero_with_ep_1_on_a_moe_model_is_accepted():
    module = ir.parse_source(_module(placements="actor.training dp 2 ep 1 zero 1 on 0..1"))
    placement = module.plan("A").placement("actor.training")
    assert (placement.zero, placement.ep) == (1, 1)
    assert ir.parse_source(ir.print_module(module)) == module
