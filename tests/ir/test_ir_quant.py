"""`quant fp8` on a generation placement (docs/ir.md, "Quantized generation weights"):
parsed, printed back exactly, compared by the diff pass, refused elsewhere."""

import pytest

import nereus.ir as ir
from nereus.passes.diff import diff_plans

SOURCE = """cluster c {
  nodes 1
  gpus_per_node 4
  gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }
  intra 900GB/s
  inter 25GB/s
  host_mem 1TB
}
model actor = llama { layers 2 hidden 256 heads 4 kv_heads 2 ffn 512 vocab 1024 }
workload w {
  batch 8 prompt 16 response 16 microbatch 2
  generation: actor
  training: actor
}
plan A {
  actor.generation dp 1 tp 4 on 0..3 quant fp8
  actor.training dp 2 tp 2 on 0..3
}
plan B = A {
  actor.generation dp 1 tp 4 on 0..3
}
"""


def test_quant_is_read_and_printed_back():
    module = ir.parse_source(SOURCE)
    assert module.plan("A").placement("actor.generation").quant == "fp8"
    assert module.plan("B").placement("actor.generation").quant is None
    printed = ir.print_module(module)
    assert "on 0..3  quant fp8" in printed
    assert ir.parse_source(printed) == module


def test_a_change_of_quant_alone_is_a_change_of_the_placement():
    """The weight sync quantizes into a quant layout even on the training mesh: the diff
    pass must not call such a stage untouched (it did: quant was not compared)."""
    module = ir.parse_source(SOURCE)
    stages = {d.model_stage: d for d in diff_plans(module, "A", "B").stages}
    assert not stages["actor.generation"].unchanged
    assert stages["actor.training"].unchanged


@pytest.mark.parametrize("edit, message", [
    (("actor.training dp 2 tp 2 on 0..3", "actor.training dp 2 tp 2 on 0..3 quant fp8"),
     "quant applies to generation only"),
    (("on 0..3 quant fp8", "on 0..3 quant fp4"), "unknown weight format 'fp4' after quant"),
])
def test_quant_is_refused_where_it_means_nothing(edit, message):
    with pytest.raises(ir.SemanticError, match=message):
        ir.parse_source(SOURCE.replace(*edit, 1))
