"""`zero 1`: optimizer state (fp32 master, Adam m and v) sharded over the dp replicas;
`zero 3`: the bf16 weights too.

IR (parse, print, rules), memory model (optimizer bytes / dp), layouts (dp units tile the
optimizer tensors together), diff (Repartition), and transitions: a DP change moves the
optimizer state about once, not once per new replica; programs verify and send exactly the
lower bound."""

import dataclasses
import json

import pytest
from builders import cluster, llama, module, place, workload

from nereus.backends.json_program import program_json
from nereus.ir import parse_source, print_module
from nereus.ir.diagnostics import ProgramError, SemanticError
from nereus.passes import compile_transition
from nereus.passes.feasibility import check_plan, model_state_bytes_per_gpu
from nereus.passes.layout import OPTIMIZER_SUFFIXES, slot_specs, tp_boxes, zero_boxes
from nereus.passes.verify import verify_program

PLAN_TEXT = """
cluster c { nodes 2 gpus_per_node 4 gpu { mem 1GB flops 1TFLOPS hbm 1TB/s } intra 100GB/s inter 10GB/s host_mem 16GB }
model actor = llama { layers 4 hidden 64 heads 8 kv_heads 2 ffn 128 vocab 256 }
workload w { batch 8 prompt 16 response 16 microbatch 1  generation: actor  training: actor }
plan S {
  actor.generation dp 2 tp 4 on 0..7
  actor.training   dp 2 tp 2 on 0..3 zero 1
}
"""


def _zero_module(before: tuple, after: tuple, tp: int = 2, pp: int = 1, layers: int = 4) -> object:
    """actor.training from (dp, zero) `before` to `after`, GPUs 0.. in order."""
    actor = llama("actor", layers, 64, 8, 2, 128, 256)
    plans = {}
    for name, (dp, zero) in (("S", before), ("T", after)):
        plans[name] = [dataclasses.replace(place("actor.training", dp, tp, pp, range(dp * tp * pp)), zero=zero)]
    return module(cluster(2, 4, 10**9), [actor], workload({"training": ["actor"]}), plans)


def _moved_bytes(data: dict) -> dict:
    """Bytes copied or sent, split into weights and optimizer state."""
    sizes = {t["name"]: 4 if t["dtype"] == "fp32" else 2 for t in data["tensors"]}
    out = {"weights": 0, "optimizer": 0}
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            if op["op"] in ("send", "copy"):
                for s in op["segments"]:
                    n = sizes[s["tensor"]]
                    for lo, hi in s["box"]:
                        n *= hi - lo
                    out["optimizer" if "#" in s["tensor"] else "weights"] += n
    return out


def _optimizer_total(data: dict, side: str = "after") -> int:
    """Optimizer bytes held per replica (replicated: one unit's; zero: all units' together),
    i.e. the state once, TP-replicated copies (norms, shared KV heads) included."""
    sizes = {t["name"]: 4 if t["dtype"] == "fp32" else 2 for t in data["tensors"]}
    units = data["units"][side]
    total = 0
    for unit in units if units[0].get("zero") else units[:1]:
        for shard in unit["shards"]:
            if "#" in shard["tensor"]:
                for box in shard["boxes"]:
                    n = sizes[shard["tensor"]]
                    for lo, hi in box:
                        n *= hi - lo
                    total += n
    return total


def test_zero_parses_prints_and_round_trips():
    m = parse_source(PLAN_TEXT, "z.nir")
    assert m.plan("S").placement("actor.training").zero == 1
    assert m.plan("S").placement("actor.generation").zero == 0
    text = print_module(m)
    assert "zero 1" in text and parse_source(text, "again.nir") == m


@pytest.mark.parametrize("edit,message", [
    ("actor.generation dp 2 tp 4 on 0..7", "zero applies to training only"),
    ("actor.training   dp 2 tp 2 on 0..3 zero 1", "zero 2 is not supported"),
])
def test_zero_rules_point_at_the_value(edit, message):
    bad = edit + " zero 1" if "generation" in edit else edit.replace("zero 1", "zero 2")
    with pytest.raises(SemanticError) as info:
        parse_source(PLAN_TEXT.replace(edit, bad), "z.nir")
    assert message in info.value.message
    assert info.value.loc is not None and info.value.loc.line in (6, 7)


def test_unknown_placement_key_lists_zero():
    with pytest.raises(SemanticError) as info:
        parse_source(PLAN_TEXT.replace("zero 1", "zer 1"), "z.nir")
    assert "did you mean 'zero'" in info.value.hint


def test_zero_boxes_chunk_the_local_tensor_along_dim_0():
    actor = llama("actor", 4, 64, 8, 2, 128, 256)
    for slot_spec in slot_specs(actor):
        spec = slot_spec.spec
        for tp in (1, 2, 4):
            for t in range(tp):
                local = tp_boxes(spec, tp, t)
                rows = sum(b[0][1] - b[0][0] for b in local)
                for dp in (1, 2, 3, 8):
                    chunks = [zero_boxes(spec, tp, t, dp, d) for d in range(dp)]
                    got = [b for c in chunks for b in c]
                    # in order, they re-assemble the local tensor row by row (torch.chunk sizes)
                    assert sum(b[0][1] - b[0][0] for b in got) == rows
                    assert [sum(b[0][1] - b[0][0] for b in c) for c in chunks][0] == min(rows, -(-rows // dp))
                    assert all(b[1:] == local[0][1:] for b in got)


def test_memory_model_divides_optimizer_state_by_dp():
    actor = llama("actor", 4, 64, 8, 2, 128, 256)
    full = model_state_bytes_per_gpu(actor, "training", 2, 1, 0)
    for dp in (2, 4):
        sharded = [model_state_bytes_per_gpu(actor, "training", 2, 1, 0, dp, 1, d) for d in range(dp)]
        assert all(s["weights"] == full["weights"] and s["grads"] == full["grads"] for s in sharded)
        assert sum(s["optimizer"] for s in sharded) == full["optimizer"]
        assert max(s["optimizer"] for s in sharded) <= -(-full["optimizer"] // dp) + 12 * 64 * 6
    m = parse_source(PLAN_TEXT, "z.nir")
    plain = parse_source(PLAN_TEXT.replace(" zero 1", ""), "p.nir")
    opt = {r.plan: {c.kind: c.bytes for c in r.worst.contributors if c.model_stage == "actor.training"}
           for r in (check_plan(m, "S"),)}
    opt_plain = {c.kind: c.bytes for c in check_plan(plain, "S").worst.contributors
                 if c.model_stage == "actor.training"}
    assert opt["S"]["optimizer"] * 2 >= opt_plain["optimizer"] > opt["S"]["optimizer"]


def test_a_70b_plan_that_needs_zero_fits_with_it():
    src = """
cluster c { nodes 8 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s inter 50GB/s host_mem 2TB }
model actor = llama { layers 80 hidden 8192 heads 64 kv_heads 8 ffn 28672 vocab 128256 }
workload w { batch 64 prompt 1024 response 1024 microbatch 1 recompute selective  training: actor }
plan S { actor.training dp 8 tp 8 on 0..63 ZERO }
"""
    assert not check_plan(parse_source(src.replace("ZERO", ""), "a.nir"), "S").feasible
    assert check_plan(parse_source(src.replace("ZERO", "zero 1"), "b.nir"), "S").feasible


def test_units_tile_the_optimizer_state_together():
    data = program_json(compile_transition(_zero_module((2, 1), (4, 1)), "S", "T"))
    for side in ("before", "after"):
        for unit in data["units"][side]:
            assert unit["zero"] == 1
            names = {s["tensor"] for s in unit["shards"]}
            # the value-free tensors of one unit: all weights, only its chunks of the state
            assert all(not n.endswith(OPTIMIZER_SUFFIXES) for n in names) or any("#" in n for n in names)
    verify_program(data)
    broken = dict(data, units=dict(data["units"], after=[dict(u) for u in data["units"]["after"]]))
    unit = broken["units"]["after"][0]
    unit["shards"] = [s for s in unit["shards"] if not s["tensor"].endswith("#exp_avg")]
    with pytest.raises(ProgramError, match="do not cover|no chunk|never allocated|written"):
        verify_program(broken)


@pytest.mark.parametrize("dp", [(1, 2), (2, 4)])
def test_dp_doubling_moves_the_optimizer_state_once_not_per_replica(dp):
    d1, d2 = dp
    moved, total = {}, {}
    for zero in (0, 1):
        compiled = compile_transition(_zero_module((d1, zero), (d2, zero)), "S", "T")
        data = program_json(compiled)
        report = verify_program(data)
        summary = compiled.summary
        assert summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"] == summary["lower_bound_bytes"]
        assert report.bytes_moved == summary["bytes"]["total"]
        moved[zero], total[zero] = _moved_bytes(data), _optimizer_total(data)
    assert total[0] == total[1]
    # replicated: every new replica receives a full copy; sharded: at most the state once
    assert moved[0]["optimizer"] == (d2 - d1) * total[0]
    assert total[1] // 2 <= moved[1]["optimizer"] <= total[1]
    assert moved[0]["weights"] == moved[1]["weights"]  # weights stay replicated either way
    summary = compile_transition(_zero_module((d1, 1), (d2, 1)), "S", "T").summary
    assert any(p.startswith("repartition(") for p in summary["stages"]["actor.training"]["primitives"])


@pytest.mark.parametrize("before,after", [((2, 0), (2, 1)), ((2, 1), (2, 0)), ((4, 1), (2, 1)), ((3, 1), (2, 1))])
def test_zero_changes_verify_and_send_the_lower_bound(before, after):
    module = _zero_module(before, after, tp=1, pp=2)
    compiled = compile_transition(module, "S", "T")
    data = program_json(compiled)
    verify_program(data, against=module)  # the header's zero units are what the plans say
    broken = json.loads(json.dumps(data))
    for unit in broken["units"]["after" if after[1] else "before"]:
        unit.pop("zero", None)
        unit.pop("dp", None)
    with pytest.raises(ProgramError):
        verify_program(broken, against=module)
    summary = compiled.summary
    assert summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"] == summary["lower_bound_bytes"]


def test_same_plan_with_zero_is_unchanged():
    m = _zero_module((2, 1), (2, 1))
    summary = compile_transition(m, "S", "T").summary
    assert summary["stages"]["actor.training"]["unchanged"]


def test_zero_3_divides_weights_grads_and_state_and_gathers_three_layers():
    actor = llama("actor", 4, 64, 8, 2, 128, 256)
    full = model_state_bytes_per_gpu(actor, "training", 2, 1, 0)
    sharded = [model_state_bytes_per_gpu(actor, "training", 2, 1, 0, 4, 3, d) for d in range(4)]
    for kind in ("weights", "grads", "optimizer"):
        assert sum(s[kind] for s in sharded) == full[kind]
    from nereus.passes.feasibility import gathered_bytes_per_gpu

    one = parse_source(PLAN_TEXT, "z1.nir")
    three = parse_source(PLAN_TEXT.replace("zero 1", "zero 3"), "z3.nir")
    z1 = model_state_bytes_per_gpu(actor, "training", 2, 1, 0, 2, 1, 0)
    z3 = model_state_bytes_per_gpu(actor, "training", 2, 1, 0, 2, 3, 0)
    # GPU 0 holds replica 0 of actor.training; in training its resident state shrinks by
    # the weights and grads it no longer holds whole, and 3 gathered layers are added
    expected = sum(z3.values()) - sum(z1.values()) + gathered_bytes_per_gpu(actor, 2)
    assert check_plan(three, "S").bytes_on(0, "training") - check_plan(one, "S").bytes_on(0, "training") == expected
    text = print_module(three)
    assert "zero 3" in text and parse_source(text, "again.nir") == three


@pytest.mark.parametrize("dp", [(1, 2), (2, 4)])
def test_zero_3_dp_doubling_moves_weights_and_state_once(dp):
    d1, d2 = dp
    compiled = compile_transition(_zero_module((d1, 3), (d2, 3)), "S", "T")
    data = program_json(compiled)
    verify_program(data)
    summary = compiled.summary
    assert summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"] == summary["lower_bound_bytes"]
    moved = _moved_bytes(data)
    replicated = program_json(compile_transition(_zero_module((d1, 0), (d2, 0)), "S", "T"))
    weights_once = sum(2 * _volume(b) for s in replicated["units"]["after"][0]["shards"] if "#" not in s["tensor"]
                       for b in s["boxes"])
    assert _moved_bytes(replicated)["weights"] == (d2 - d1) * weights_once  # a copy per new replica
    assert moved["weights"] <= weights_once  # sharded: at most once
    assert moved["optimizer"] <= _optimizer_total(data)
    for unit in data["units"]["after"]:
        assert unit["zero"] == 3


@pytest.mark.parametrize("before,after", [((2, 1), (2, 3)), ((2, 3), (4, 1)), ((4, 3), (2, 0)), ((3, 3), (2, 3))])
def test_zero_3_changes_verify_and_send_the_lower_bound(before, after):
    compiled = compile_transition(_zero_module(before, after, tp=1, pp=2), "S", "T")
    verify_program(program_json(compiled))
    summary = compiled.summary
    assert summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"] == summary["lower_bound_bytes"]


def _volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


@pytest.mark.parametrize("before,after", [(9, 4), (4, 9)])
def test_a_replica_whose_chunks_are_all_empty_still_verifies(before, after):
    # 1 layer, hidden 16: no tensor has more than 64 rows, so at dp 9 (chunks of 8 rows)
    # replica 8 holds nothing at all; its GPU still gets its alloc and free
    actor = llama("actor", 1, 16, 4, 1, 32, 32)
    plans = {name: [dataclasses.replace(place("actor.training", dp, 1, 1, range(dp)), zero=3)]
             for name, dp in (("S", before), ("T", after))}
    m = module(cluster(3, 4, 10**9), [actor], workload({"training": ["actor"]}), plans)
    data = program_json(compile_transition(m, "S", "T"))
    empty = [u for side in data["units"].values() for u in side if not u["shards"]]
    assert [u["id"] for u in empty] == ["actor.training/8"]
    verify_program(data)
