"""`--set KEY=VALUE` overrides: valid ones change the module and keep it valid; invalid
ones fail with the exact error text located in `<--set>`."""

import pytest

import nereus.ir as ir

SOURCE = """cluster c {
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
  generation: actor
  training: actor
}
plan A {
  actor.generation dp 2 tp 4 on n0..n1
  actor.training dp 1 tp 2 pp 2 on n1
}
"""


@pytest.fixture(scope="module")
def module():
    return ir.parse_source(SOURCE, "t.nir")


def test_workload_values(module):
    changed = ir.apply_overrides(module, ["workload.response=8192", "workload.batch=64", "workload.prompt=2048",
                                          "workload.microbatch=8", "workload.recompute=selective"])
    w = changed.workload
    assert (w.batch, w.prompt, w.response, w.microbatch, w.recompute) == (64, 2048, 8192, 8, "selective")
    assert changed.plans == module.plans and changed.cluster == module.cluster
    assert module.workload.response == 16  # the input is not modified


def test_spaces_around_the_key_and_value_are_not_part_of_them(module):
    """A shell quote easily keeps a space: `--set 'workload.response=8192 '`."""
    changed = ir.apply_overrides(module, ["workload.response=8192 ", " workload.batch = 64"])
    assert (changed.workload.response, changed.workload.batch) == (8192, 64)


def test_cluster_values(module):
    changed = ir.apply_overrides(module, ["cluster.gpu.mem=141GB", "cluster.intra=1.8TB/s", "cluster.reserve=5%",
                                          "cluster.host_mem=2TiB", "cluster.gpu.flops=1PFLOPS"])
    c = changed.cluster
    assert (c.gpu.mem_bytes, c.intra_bytes_per_s, c.reserve, c.host_mem_bytes, c.gpu.flops) == \
        (141 * 10**9, 1.8e12, 0.05, 2 * 2**40, 1e15)
    assert "reserve 5%" in ir.print_module(changed)


def test_cluster_change_resolves_node_sets_again():
    source = SOURCE.replace("actor.generation dp 2 tp 4 on n0..n1", "actor.generation dp 1 on n1:1").replace(
        "actor.training dp 1 tp 2 pp 2 on n1", "actor.training dp 2 on n0:0, n1:0")
    module = ir.parse_source(source, "t.nir")
    assert module.plan("A").placement("actor.generation").gpus == (5,)
    changed = ir.apply_overrides(module, ["cluster.gpus_per_node=2", "cluster.nodes=3"])
    plan = changed.plan("A")
    assert plan.placement("actor.generation").gpus == (3,)
    assert plan.placement("actor.training").gpus == (0, 2)
    assert plan.declared[0] is plan.placements[0]  # one placement object, resolved once
    assert "on n1:1" in ir.print_module(changed)


def test_later_value_wins_and_last_value_is_printed(module):
    changed = ir.apply_overrides(module, ["workload.response=100", "workload.response=200"])
    assert changed.workload.response == 200
    assert "response 200" in ir.print_module(changed)
    assert ir.parse_source(ir.print_module(changed)) == changed


def test_no_overrides_is_identity(module):
    assert ir.apply_overrides(module, []) is module


INVALID = [
    (["workload.respons=8192"],
     "<--set>:1:1: error: unknown key 'workload.respons' for --set\n"
     "    1 | workload.respons=8192\n"
     "      | ^^^^^^^^^^^^^^^^\n"
     "hint: did you mean 'workload.response'? keys: workload.batch, workload.prompt, workload.response, "
     "workload.microbatch, workload.recompute, cluster.nodes, cluster.gpus_per_node, cluster.intra, cluster.inter, "
     "cluster.host_mem, cluster.reserve, cluster.gpu.mem, cluster.gpu.flops, cluster.gpu.hbm"),
    (["workload.response=8192", "workload.batch=0"],
     "<--set>:1:39: error: batch must be at least 1, found 0\n"
     "    1 | workload.response=8192 workload.batch=0\n"
     "      |                                       ^\n"
     "hint: write batch 1 or more"),
    (["workload.response"],
     "<--set>:1:1: error: expected KEY=VALUE, found 'workload.response'\n"
     "    1 | workload.response\n"
     "      | ^^^^^^^^^^^^^^^^^\n"
     "hint: write it like workload.response=8192"),
    (["workload.response="],
     "<--set>:1:19: error: workload.response needs a value after '='\n"
     "    1 | workload.response=\n"
     "      |                   ^\n"
     "hint: write it like workload.response=VALUE"),
    (["workload.response=8k"],
     "<--set>:1:19: error: response takes a plain number, found unit 'k'\n"
     "    1 | workload.response=8k\n"
     "      |                   ^^\n"
     "hint: write response 8"),
    (["workload.batch=1"],
     "<--set>:1:16: error: microbatch 2 is larger than batch 1 (after --set)\n"
     "    1 | workload.batch=1\n"
     "      |                ^\n"
     "hint: use a microbatch of at most 1; it clashes with t.nir:11:44"),
    (["cluster.nodes=1"],
     "<--set>:1:15: error: node n1 does not exist (after --set)\n"
     "    1 | cluster.nodes=1\n"
     "      |               ^\n"
     "hint: cluster c has 1 node x 4 GPUs: the only node is n0; it clashes with t.nir:16:33"),
    (["cluster.gpus_per_node=8"],
     "<--set>:1:23: error: the GPU set of actor.generation has 16 GPUs, but dp x tp x pp = 2 x 4 x 1 = 8 "
     "(after --set)\n"
     "    1 | cluster.gpus_per_node=8\n"
     "      |                       ^\n"
     "hint: give 8 GPUs (e.g. on 0..7) or change dp to 4; it clashes with t.nir:16:33"),
    (["cluster.gpu.mem=80"],
     "<--set>:1:17: error: mem needs a unit\n"
     "    1 | cluster.gpu.mem=80\n"
     "      |                 ^^\n"
     "hint: write it like 141GB or 80GiB; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    (["cluster.reserve=120%"],
     "<--set>:1:17: error: reserve must be at least 0% and below 100%, found 120%\n"
     "    1 | cluster.reserve=120%\n"
     "      |                 ^^^^\n"
     "hint: the share of each GPU's memory kept free, e.g. reserve 5%"),
    (["workload.recompute=some"],
     "<--set>:1:20: error: recompute must be 'none', 'selective' or 'full', found 'some'\n"
     "    1 | workload.recompute=some\n"
     "      |                    ^^^^\n"
     "hint: did you mean 'none'?"),
]


@pytest.mark.parametrize("overrides,expected", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_overrides(module, overrides, expected):
    with pytest.raises(ir.SemanticError) as caught:
        ir.apply_overrides(module, overrides)
    assert caught.value.format() == expected


# ---------------------------------------------------------------- random modules

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_ir_roundtrip import modules  # noqa: E402


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(modules(), st.sampled_from(["batch", "prompt", "response", "microbatch"]), st.integers(-3, 5000))
def test_random_workload_overrides(module, key, value):
    text = f"workload.{key}={value}"
    try:
        changed = ir.apply_overrides(module, [text])
    except ir.SemanticError as error:
        assert error.loc is not None and error.loc.file == "<--set>"
        w = module.workload
        assert value < 1 or (key == "microbatch" and w.batch % value) or (key == "batch" and value % w.microbatch)
        return
    assert getattr(changed.workload, key) == value
    assert ir.parse_source(ir.print_module(changed)) == changed
