"""`tensors` models and mesh layouts (docs/ir.md, "Models given as tensor tables"): parse,
print, round-trip, the boxes each GPU holds, and the exact error text of every rule."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nereus.ir as ir
from nereus.ir.mesh import chunk, local_ranges, mesh_boxes
from nereus.ir.model import DimPlacement, TensorDecl
from nereus.ir.table import expand_name
from nereus.ir.tablegroup import grouped_names

BASE = """cluster c {
  nodes 1
  gpus_per_node 4
  gpu { mem 16GB flops 100TFLOPS hbm 1TB/s }
  intra 100GB/s
  inter 10GB/s
  host_mem 64GB
}
model policy = tensors {
  dtype bf16
  states: exp_avg, exp_avg_sq
  tensor "model.embed_tokens.weight" [64, 16]
  tensor "model.layers.{0..1}.self_attn.q_proj.weight" [16, 16]
  tensor "model.layers.{0..1}.self_attn.o_proj.weight" [16, 16]
  tensor "model.norm.weight" [16]
}
workload w { batch 4 prompt 8 response 8 microbatch 1  training: policy }
plan A {
  policy.training mesh (dp 2, tp 2) on 0..3 {
    "*.q_proj.weight" strided(0, 2) shard(0)
    "*.o_proj.weight" shard(0) shard(1)
    "*" shard(0) replicate
  }
}
plan B {
  policy.training mesh (tp 4) on 0..3 {
    "*.q_proj.weight" shard(0)
    "*.o_proj.weight" shard(1)
    "*" replicate
  }
}
transition A -> B
"""

CANONICAL_A = """plan A {
  policy.training  mesh (dp 2, tp 2)  on 0..3 {
    "*.q_proj.weight"  strided(0, 2)  shard(0)
    "*.o_proj.weight"  shard(0)       shard(1)
    "*"                shard(0)       replicate
  }
}"""


def test_parse_and_print():
    module = ir.parse_source(BASE, "t.nir")
    model = module.model("policy")
    assert model.is_table and model.states == ("exp_avg", "exp_avg_sq")
    assert [t.name for t in model.tensors] == [  # canonical (natural) order
        "model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"]
    placement = module.plan("A").placement("policy.training")
    assert (placement.dp, placement.tp, placement.pp) == (1, 4, 1)
    text = ir.print_module(module)
    assert CANONICAL_A in text
    assert 'tensor "model.layers.{0..1}.self_attn.o_proj.weight" [16, 16]' in text
    assert ir.parse_source(text, "t.nir") == module
    assert ir.print_module(ir.parse_source(text, "t.nir")) == text


def test_fsdp_over_tp_boxes_follow_torch_docs():
    """The example of torch's _StridedShard docstring: an [8, 8] tensor on a 2 x 2
    (dp, tp) mesh with (_StridedShard(0, sf=2), Shard(0)) puts rows 0-1, 4-5, 2-3, 6-7 on
    ranks 0..3 (scaled here to 16 rows)."""
    placement = ir.parse_source(BASE, "t.nir").plan("A").placement("policy.training")
    rows = [mesh_boxes("model.layers.0.self_attn.q_proj.weight", (16, 16), placement, r)[0][0] for r in range(4)]
    assert rows == [(0, 4), (8, 12), (4, 8), (12, 16)]
    o = [mesh_boxes("model.layers.0.self_attn.o_proj.weight", (16, 16), placement, r) for r in range(4)]
    assert o[1] == (((0, 8), (8, 16)),)


def test_uneven_chunks_as_torch_chunk():
    # 10 rows over 4: torch.chunk gives 3, 3, 3, 1; 2 rows over 4: 1, 1, 0, 0
    assert [chunk(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert local_ranges((2, 5), (4,), (3,), (DimPlacement("shard", 0),)) == ((), ((0, 5),))


def test_brace_ranges_expand_nested():
    assert expand_name("l.{0..1}.e.{2..3}") == ["l.0.e.2", "l.0.e.3", "l.1.e.2", "l.1.e.3"]
    assert expand_name("x.{2..0}") == ["x.2", "x.1", "x.0"]


names = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.sampled_from(["w", "b", "01"])),
                 min_size=1, max_size=30, unique=True)


@settings(max_examples=60, deadline=None)
@given(names, st.sampled_from([(4,), (4, 2)]))
def test_grouped_names_expand_to_the_table(items, shape):
    tensors = [TensorDecl(f"layers.{a}.experts.{b}.{c}", shape if c != "b" else (2,)) for a, b, c in items]
    lines = grouped_names(tensors)
    expanded = sorted((name, s) for pattern, s in lines for name in expand_name(pattern))
    assert expanded == sorted((t.name, t.shape) for t in tensors)


def test_moe_table_prints_in_one_line_per_kind():
    tensors = [TensorDecl(f"model.layers.{l}.mlp.experts.{e}.down_proj.weight", (8, 4))
               for l in range(48) for e in range(128)]
    assert grouped_names(tensors) == [("model.layers.{0..47}.mlp.experts.{0..127}.down_proj.weight", (8, 4))]


ERRORS = [
    ("unknown_placement", ('"*" shard(0) replicate', '"*" shard(0) replicat'),
     "t.nir:22:18: error: unknown placement 'replicat'\n"
     "   22 |     \"*\" shard(0) replicat\n"
     "      |                  ^^^^^^^^\n"
     "hint: did you mean 'replicate'? a mesh dimension takes replicate, shard(DIM) or strided(DIM, SPLIT)"),
    ("placement_count", ('"*.o_proj.weight" shard(0) shard(1)', '"*.o_proj.weight" shard(0)'),
     "t.nir:21:5: error: the rule \"*.o_proj.weight\" gives 1 placement for a mesh of 2 dimensions (dp 2, tp 2)\n"
     "   21 |     \"*.o_proj.weight\" shard(0)\n"
     "      |     ^^^^^^^^^^^^^^^^^\n"
     "hint: give one of replicate, shard(DIM), strided(DIM, SPLIT) per mesh dimension, in order"),
    ("rule_matches_nothing", ('"*.o_proj.weight" shard(0) shard(1)', '"*.out_proj.weight" shard(0) shard(1)'),
     "t.nir:21:5: error: the rule \"*.out_proj.weight\" matches no tensor of policy\n"
     "   21 |     \"*.out_proj.weight\" shard(0) shard(1)\n"
     "      |     ^^^^^^^^^^^^^^^^^^^\n"
     "hint: patterns match whole names: * any text, ? one character"),
    ("tensor_unmatched", ('    "*" shard(0) replicate\n', ''),
     "t.nir:19:45: error: no layout rule of policy.training matches tensor model.embed_tokens.weight (and 1 more)\n"
     "   19 |   policy.training mesh (dp 2, tp 2) on 0..3 {\n"
     "      |                                             ^\n"
     "hint: add a rule for it, e.g. \"*\" with replicate for every mesh dimension"),
    ("dim_out_of_range", ('"*" shard(0) replicate', '"*" shard(1) replicate'),
     "t.nir:22:9: error: shard(1) splits dimension 1 of model.norm.weight, which has 1\n"
     "   22 |     \"*\" shard(1) replicate\n"
     "      |         ^^^^^\n"
     "hint: dimensions of model.norm.weight run 0..0"),
    ("strided_off_dim_0", ('"*.o_proj.weight" shard(0) shard(1)', '"*.o_proj.weight" strided(1, 2) replicate'),
     "t.nir:21:5: error: model.layers.0.self_attn.o_proj.weight on GPU 0: its shards take several ranges of "
     "dimension 1\n"
     "   21 |     \"*.o_proj.weight\" strided(1, 2) replicate\n"
     "      |     ^^^^^^^^^^^^^^^^^\n"
     "hint: a shard may take several ranges of dimension 0 only (its boxes are stacked along dim 0); split other "
     "dimensions with shard(DIM)"),
    ("mesh_size", ("mesh (dp 2, tp 2) on 0..3", "mesh (dp 2, tp 2) on 0..1"),
     "t.nir:19:40: error: mesh (dp 2, tp 2) has 4 GPUs, the GPU set of policy.training 2\n"
     "   19 |   policy.training mesh (dp 2, tp 2) on 0..1 {\n"
     "      |                                        ^^^^\n"
     "hint: give the mesh as many GPUs as its sizes multiply to"),
    ("mesh_and_tp", ("mesh (tp 4) on 0..3", "tp 4 mesh (tp 4) on 0..3"),
     "t.nir:26:19: error: 'tp' and 'mesh' both split policy.training in plan B\n"
     "   26 |   policy.training tp 4 mesh (tp 4) on 0..3 {\n"
     "      |                   ^^\n"
     "hint: a mesh layout says how its GPUs split each tensor: drop 'tp'"),
    ("layout_without_mesh", ("mesh (tp 4) on 0..3", "on 0..3"),
     "t.nir:26:27: error: layout rules without a mesh for policy.training in plan B\n"
     "   26 |   policy.training on 0..3 {\n"
     "      |                           ^\n"
     "hint: name the mesh they split, e.g. mesh (dp 2, tp 2) on 0..3 { ... }"),
    ("table_needs_mesh", ("""  policy.training mesh (tp 4) on 0..3 {
    "*.q_proj.weight" shard(0)
    "*.o_proj.weight" shard(1)
    "*" replicate
  }""", "  policy.training dp 4 on 0..3"),
     "t.nir:26:3: error: policy is a tensors model: policy.training needs a mesh layout\n"
     "   26 |   policy.training dp 4 on 0..3\n"
     "      |   ^^^^^^^^^^^^^^^\n"
     "hint: place it like mesh (dp 2) on 0..1 { \"*\" shard(0) }"),
    ("tensor_twice", ('tensor "model.norm.weight" [16]', 'tensor "model.norm.weight" [16]\n  tensor "model.norm.weight" [8]'),
     "t.nir:16:10: error: tensor 'model.norm.weight' is declared twice in model 'policy'\n"
     "   16 |   tensor \"model.norm.weight\" [8]\n"
     "      |          ^^^^^^^^^^^^^^^^^^^\n"
     "hint: the first is at 15:10; keep one"),
    ("hash_in_name", ('"model.norm.weight" [16]', '"model.norm#weight" [16]'),
     "t.nir:15:10: error: tensor name 'model.norm#weight' contains '#'\n"
     "   15 |   tensor \"model.norm#weight\" [16]\n"
     "      |          ^^^^^^^^^^^^^^^^^^^\n"
     "hint: '#' separates a tensor from its optimizer states"),
    ("tensor_elsewhere", ("  host_mem 64GB", '  host_mem 64GB\n  tensor "x" [2]'),
     "t.nir:8:3: error: a tensor declaration in cluster 'c'\n"
     "    8 |   tensor \"x\" [2]\n"
     "      |   ^^^^^^\n"
     "hint: tensors are declared only in a model = tensors { ... } block"),
    ("zero_dim", ('"model.norm.weight" [16]', '"model.norm.weight" [0]'),
     "t.nir:15:31: error: a tensor dimension must be at least 1, found 0\n"
     "   15 |   tensor \"model.norm.weight\" [0]\n"
     "      |                               ^\n"
     "hint: write a tensor dimension 1 or more"),
]


@pytest.mark.parametrize("name,edit,expected", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_text(name, edit, expected):
    old, new = edit
    assert old in BASE
    with pytest.raises(ir.NereusError) as caught:
        ir.parse_source(BASE.replace(old, new, 1), "t.nir")
    assert caught.value.format() == expected
