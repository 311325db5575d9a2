"""Range rules: absurd counts and sizes, and microbatch dividing batch, each reported at
the offending value with the bound in the hint (exact text, caret included)."""

import pytest

import nereus.ir as ir

BASE = """cluster c {
  nodes 2
  gpus_per_node 4
  gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }
  intra 900GB/s
  inter 25GB/s
  host_mem 1TB
}
model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }
workload w {
  batch 8 prompt 16 response 16 microbatch 2
  training: actor
}
plan A {
  actor.training dp 2 tp 2 pp 2 on 0..7
}
"""

CASES = [
    ("absurd_layers", ("layers 4 ", "layers 99999999999999999999999999 "), "\n".join([
        "t.nir:9:30: error: layers 99999999999999999999999999 is above the limit of 4096",
        "    9 | model actor = llama { layers 99999999999999999999999999 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }",
        "      |                              ^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "hint: model actor takes layers from 1 to 4096 (a sanity bound; a larger value is almost surely a typo)"])),
    ("absurd_vocab", ("vocab 1024", "vocab 1000000000"), "\n".join([
        "t.nir:9:76: error: vocab 1000000000 is above the limit of 16777216",
        "    9 | model actor = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1000000000 }",
        "      |                                                                            ^^^^^^^^^^",
        "hint: model actor takes vocab from 1 to 16777216 (a sanity bound; a larger value is almost surely a typo)"])),
    ("absurd_response", ("response 16", "response 123456789012"), "\n".join([
        "t.nir:11:30: error: response 123456789012 is above the limit of 16777216",
        "   11 |   batch 8 prompt 16 response 123456789012 microbatch 2",
        "      |                              ^^^^^^^^^^^^",
        "hint: workload w takes response from 1 to 16777216 (a sanity bound; a larger value is almost surely a typo)"])),
    ("absurd_gpu_memory", ("mem 80GB", "mem 80000TB"), "\n".join([
        "t.nir:4:13: error: mem 80000TB is above the limit of 1000TB",
        "    4 |   gpu { mem 80000TB flops 989TFLOPS hbm 3.35TB/s }",
        "      |             ^^^^^^^",
        "hint: cluster c takes mem up to 1000TB (a sanity bound; a larger value is almost surely a typo)"])),
    ("microbatch_not_dividing_batch", ("microbatch 2", "microbatch 3"), "\n".join([
        "t.nir:11:44: error: microbatch 3 must divide batch (8)",
        "   11 |   batch 8 prompt 16 response 16 microbatch 3",
        "      |                                            ^",
        "hint: a step runs batch / microbatch whole microbatches; microbatches that divide 8: 1, 2, 4, 8"])),
]


@pytest.mark.parametrize("name,edit,expected", CASES, ids=[case[0] for case in CASES])
def test_range_error_text(name, edit, expected):
    old, new = edit
    assert old in BASE
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(BASE.replace(old, new, 1), "t.nir")
    assert caught.value.format() == expected


def test_bounds_hold_after_set_overrides():
    module = ir.parse_source(BASE, "t.nir")
    with pytest.raises(ir.NereusError, match="microbatch 3 must divide batch"):
        ir.apply_overrides(module, ["workload.microbatch=3"])
    with pytest.raises(ir.NereusError, match="batch 99999999999 is above the limit"):
        ir.apply_overrides(module, ["workload.batch=99999999999"])


def test_the_bounds_admit_the_largest_real_models():
    # llama 3.1 405B: 126 layers, hidden 16384, ffn 53248, vocab 128256, 128k context
    text = BASE.replace("layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024",
                        "layers 126 hidden 16384 heads 128 kv_heads 8 ffn 53248 vocab 128256")
    text = text.replace("response 16", "response 131072").replace("mem 80GB", "mem 1000TB")
    ir.parse_source(text, "t.nir")
