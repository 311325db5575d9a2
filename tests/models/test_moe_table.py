"""The qwen3_moe family: its tensor table against the published Qwen3-30B-A3B config and
transformers' Qwen3MoeForCausalLM, and its HF names."""

from pathlib import Path

import pytest

import nereus.ir as ir
from nereus.models import parameter_count, tensor_table
from nereus.models.hf import hf_targets

DATA = Path(__file__).parents[1] / "data" / "hf" / "qwen3-30b-a3b"
# transformers 5.24 AutoModelForCausalLM.from_config(...).num_parameters() on the meta device;
# by hand: embed and lm_head 2 * 151936 * 2048, final norm 2048, and 48 layers of
# q 4096*2048, k and v 512*2048 each, o 2048*4096, norms 2*2048 + 2*128, router 128*2048,
# 128 experts of 3 * 768*2048.
QWEN3_30B_A3B = 30_532_122_624


def _model():
    text = ("cluster c { nodes 1 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s "
            f"inter 25GB/s host_mem 2TB }}\nmodel actor = hf(\"{DATA}\")\n"
            "workload w { batch 8 prompt 512 response 512 microbatch 1 inference: actor }\n"
            "plan A { actor.inference dp 1 ep 8 on 0..7 }\n")
    return ir.parse_source(text, "<count>").model("actor")


def test_parameter_count_by_hand():
    by_hand = 2 * 151936 * 2048 + 2048 + 48 * (
        4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 2 * 2048 + 2 * 128 + 128 * 2048 + 128 * 3 * 768 * 2048)
    assert by_hand == QWEN3_30B_A3B
    model = _model()
    assert parameter_count(model) == QWEN3_30B_A3B
    assert sum(spec.numel for spec in tensor_table(model)) == QWEN3_30B_A3B


def test_expert_tensors_carry_their_expert():
    specs = {s.name: s for s in tensor_table(_model())}
    gate_up = specs["layers.47.mlp.experts.127.gate_up.weight"]
    assert (gate_up.shape, gate_up.expert, gate_up.experts, gate_up.sharding) == ((1536, 2048), 127, 128, "column")
    assert [p.name for p in gate_up.parts] == ["gate", "up"]
    assert specs["layers.0.mlp.experts.5.down.weight"].shape == (2048, 768)
    assert specs["layers.0.mlp.router.weight"].expert is None
    assert "layers.0.mlp.gate_up.weight" not in specs  # no dense MLP
    assert gate_up.ep_owner(16) == 15 and specs["layers.0.mlp.experts.8.down.weight"].ep_owner(16) == 1


def test_hf_names_are_the_checkpoint_names():
    targets = hf_targets(_model())
    t = targets["model.layers.3.mlp.experts.7.up_proj.weight"]
    assert (t.tensor, t.rows, t.shape) == ("actor/layers.3.mlp.experts.7.gate_up.weight", (768, 1536), (768, 2048))
    assert targets["model.layers.3.mlp.gate.weight"].tensor == "actor/layers.3.mlp.router.weight"
    assert targets["model.layers.3.self_attn.q_norm.weight"].shape == (128,)
    assert sum(_numel(t.shape) for t in targets.values()) == QWEN3_30B_A3B


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_counts_equal_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(DATA)
    with torch.device("meta"):  # shapes only: no memory
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    assert hf_model.num_parameters() == QWEN3_30B_A3B == parameter_count(_model())
    # transformers 5 stacks the checkpoint's per-expert tensors; the stacks equal ours
    shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    targets = hf_targets(_model())
    stacked = shapes.get("model.layers.0.mlp.experts.gate_up_proj")
    if stacked is not None:
        gate = targets["model.layers.0.mlp.experts.0.gate_proj.weight"].shape
        assert stacked == (128, 2 * gate[0], gate[1])
        assert shapes["model.layers.0.mlp.experts.down_proj"] == \
            (128,) + targets["model.layers.0.mlp.experts.0.down_proj.weight"].shape
    else:  # transformers 4.x: the per-expert names themselves
        assert {n: t.shape for n, t in targets.items()} == shapes
