"""The llama tensor table: exact parameter counts and sharding rules."""

from nereus.models import (COLUMN, REPLICATED, ROW, VOCAB, parameter_count, pp_layer_range,
                                    tensor_table)
from nereus.ir.model import Model


def llama(layers, hidden, heads, kv, ffn, vocab, head="lm"):
    return Model("m", "llama", layers, hidden, heads, kv, ffn, vocab, "bf16", head)


def test_llama_3_1_8b_parameter_count():
    assert parameter_count(llama(32, 4096, 32, 8, 14336, 128256)) == 8_030_261_248


def test_llama_3_1_70b_parameter_count():
    assert parameter_count(llama(80, 8192, 64, 8, 28672, 128256)) == 70_553_706_496


def test_table_sums_to_parameter_count_and_value_head_replaces_lm_head():
    model = llama(4, 256, 8, 2, 512, 1000)
    table = tensor_table(model)
    assert sum(t.numel for t in table) == parameter_count(model)
    critic = llama(4, 256, 8, 2, 512, 1000, head="value")
    names = [t.name for t in tensor_table(critic)]
    assert "value_head.weight" in names and "lm_head.weight" not in names
    # the value head is [1, hidden]: the critic has vocab*hidden - hidden fewer parameters
    assert parameter_count(model) - parameter_count(critic) == 1000 * 256 - 256


def test_fused_parts_and_sharding_rules():
    model = llama(2, 256, 8, 2, 512, 1000)
    by_name = {t.name: t for t in tensor_table(model)}
    qkv = by_name["layers.1.attn.qkv.weight"]
    # head_dim 32: q 8 heads = 256 rows, k and v 2 heads = 64 rows each
    assert qkv.shape == (384, 256) and qkv.sharding == COLUMN
    assert [(p.name, p.rows, p.groups) for p in qkv.parts] == [("q", 256, 8), ("k", 64, 2), ("v", 64, 2)]
    gate_up = by_name["layers.0.mlp.gate_up.weight"]
    assert gate_up.shape == (1024, 256) and [p.rows for p in gate_up.parts] == [512, 512]
    assert by_name["layers.0.attn.o.weight"].sharding == ROW
    assert by_name["layers.0.mlp.down.weight"].shape == (256, 512)
    assert by_name["embed.weight"].sharding == VOCAB and by_name["lm_head.weight"].sharding == VOCAB
    assert by_name["final_norm.weight"].sharding == REPLICATED
    assert by_name["layers.0.attn.qkv.weight"].layer == 0 and by_name["embed.weight"].layer is None


def test_pipeline_split_is_contiguous_and_front_loaded():
    assert [pp_layer_range(10, 4, s) for s in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [pp_layer_range(32, 2, s) for s in range(2)] == [(0, 16), (16, 32)]
