"""A TP or EP group that spans nodes is a located warning of `nereusc check` and `nereusc FILE`
(stderr; a "warnings" string under --json), never an error."""

import json

import pytest
from click.testing import CliRunner

import nereus.ir as ir
from nereus.cli import nereusc
from nereus.ir.node_groups import node_span_warnings, spanning_groups

SOURCE = """\
cluster c {
  nodes 8
  gpus_per_node 8
  gpu { mem 141GB  flops 989TFLOPS  hbm 4.8TB/s }
  intra 900GB/s
  inter 25GB/s
  host_mem 2TB
}
model actor  = llama { layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 vocab 128256 dtype bf16 }
workload w {
  batch 512  prompt 1024  response 2048  microbatch 2
  generation: actor
  training:   actor
}
plan S1 {
  actor.generation  dp 16 tp 4  on 2..63, 0, 1
  actor.training    dp 4 tp 16  on 0..63
}
plan S2 = S1 {
  actor.generation  dp 16 tp 4  on 0..63
  actor.training    dp 8 tp 8   on 0..63
}
"""

MOE = """\
cluster c {
  nodes 2
  gpus_per_node 4
  gpu { mem 1GB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 8GB
}
model actor = qwen3_moe { layers 2 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 16 dtype fp32
                          experts 4 experts_per_token 2 expert_ffn 8 }
workload w {
  batch 8  prompt 5  response 4  microbatch 1
  training: actor
}
plan E {
  actor.training  dp 1 ep 4 tp 2  on 0..7
}
plan F {
  actor.training  dp 2 ep 2 tp 2  on 0..7
}
"""


@pytest.fixture
def spans(tmp_path):
    path = tmp_path / "spans.nir"
    path.write_text(SOURCE)
    return str(path)


def test_check_warns_at_the_set_with_the_group_its_nodes_and_a_hint(spans):
    result = CliRunner().invoke(nereusc, ["check", spans])
    assert result.exit_code == 0, result.output  # a warning, not an error
    err = result.stderr
    assert (f"{spans}:16:36: warning: 8 of 16 TP groups of actor.generation in plan S1 span nodes: the first, "
            "replica 1, has GPUs 6..9 on nodes 0, 1 (its all-reduces cross the inter-node network)\n"
            "   16 |   actor.generation  dp 16 tp 4  on 2..63, 0, 1\n"
            "      |                                    ^^^^^^^^^^^\n"
            "hint: a node-aligned set keeps each group in one node, e.g. on 0..63\n") in err
    assert (f"{spans}:17:36: warning: 4 of 4 TP groups of actor.training in plan S1 span nodes: the first, "
            "replica 0, has GPUs 0..15 on nodes 0, 1") in err
    assert "hint: a tp of at most 8 (gpus_per_node) keeps each group in one node" in err
    assert "plan S2" not in err  # its own lines are node-aligned; the inherited ones warned once, in S1


def test_json_lists_the_warnings_and_compile_warns_too(spans):
    result = CliRunner().invoke(nereusc, ["check", spans, "--json"])
    assert result.exit_code == 0
    warnings = json.loads(result.stdout)["warnings"]
    assert len(warnings) == 2 and warnings[0].startswith(f"{spans}:16:36: 8 of 16 TP groups")
    assert warnings[0].endswith("; hint: a node-aligned set keeps each group in one node, e.g. on 0..63")
    compiled = CliRunner().invoke(nereusc, [spans])
    assert compiled.exit_code == 0 and f"{spans}:17:36: warning: 4 of 4 TP groups" in compiled.stderr
    assert json.loads(CliRunner().invoke(nereusc, [spans, "--json"]).stdout)["warnings"] == warnings


def test_an_ep_group_across_nodes_warns_and_one_inside_a_node_does_not():
    module = ir.parse_source(MOE, "moe.nir")
    warnings = node_span_warnings(module, MOE)
    assert [w.loc.line for w in warnings] == [16]
    assert warnings[0].message.startswith("1 of 1 EP groups of actor.training in plan E span nodes")
    assert "an ep x tp of at most 4 (gpus_per_node)" in warnings[0].hint
    assert spanning_groups(module.cluster, module.plan("F").placements[0], "ep") == []


def test_a_node_aligned_plan_does_not_warn():
    module = ir.parse_source(SOURCE.replace("on 2..63, 0, 1", "on 0..63").replace("dp 4 tp 16", "dp 8 tp 8 "),
                             "aligned.nir")
    assert node_span_warnings(module) == []
