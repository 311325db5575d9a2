"""A warm transition's fixed host cost, on 2 gloo ranks: the control-group collectives
are counted (one agreement per round, the first of them an all_gather that also carries
the registrations and Adam steps, and the commit's all_gather that also carries the
report's figures), a registration on one rank between transitions (which the first
agreement finds) is still honoured on every rank, the report's
fields equal values computed apart (from the lowered programs and every rank's report),
and a failure at the commit, where the figures travel, still aborts every rank with the
same error and leaves the old state in place and the runtime usable."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import nereus.ir as ir
from nereus.runtime import Runtime, TransitionAborted
from nereus.runtime.state import step_name

from runtime_helpers import spawn, spawn_ok

pytestmark = pytest.mark.multiprocess

SOURCE = """
cluster cpu {
  nodes 1
  gpus_per_node 2
  gpu { mem 1GB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 8GB
}
model actor = llama { layers 2 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
workload ppo {
  batch 4  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor
}
plan A {
  actor.generation  dp 2       on 0, 1
  actor.training    dp 1 tp 2  on 0, 1
}
plan B {
  actor.generation  dp 1 tp 2  on 0, 1
  actor.training    dp 2       on 0, 1
}
"""
STAGES = ("actor.generation", "actor.training")
STEP = 23
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
               "gather", "scatter", "reduce", "barrier", "all_to_all", "reduce_scatter")


def _count_control(rt: Runtime) -> dict:
    """Wrap torch.distributed's collectives; count those on the runtime's control group."""
    counts: dict = {}
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            group = kwargs.get("group", args[2] if _name in ("all_gather", "all_gather_object") and len(args) > 2
                               else None)
            if group is rt._control:
                counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
    return counts


def _state_bytes(rt: Runtime) -> dict:
    return {ms: {k: v.clone() for k, v in rt.state(ms).items()} for ms in STAGES}


def _same(a: dict, b: dict) -> bool:
    return all(set(a[ms]) == set(b[ms]) and all(torch.equal(a[ms][k], b[ms][k]) for k in a[ms]) for ms in a)


def _run(rank, world):
    module = ir.parse_source(SOURCE, "overhead.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world, direct_min_bytes=1024)
    gen = torch.Generator().manual_seed(3)
    for ms in STAGES:
        full = {name: (torch.tensor(STEP, dtype=torch.int64) if name.endswith("#step")
                       else torch.randn(shape, generator=gen).to(dtype))
                for name, (shape, dtype) in rt.tensor_specs(ms).items()}
        rt.register(ms, rt.shard_state_dict(ms, full))
    out = {"warm": []}
    rt.transition("B")  # cold: compiles, gathers the registered sets
    rt.transition("A")
    counts = _count_control(rt)
    for target in ("B", "A", "B", "A"):
        counts.clear()
        report = rt.transition(target)
        key = next(k for k in rt._lowered if k[:2] == (report.source, target))
        prog = rt._lowered[key]
        out["warm"].append({
            "counts": dict(counts), "rounds": len(prog.rounds), "report": report.to_json(),
            "program": {"send": prog.send_bytes, "recv": prog.recv_bytes, "copy": prog.copy_bytes,
                        "keep": prog.keep_bytes},
            "step": int(rt.state("actor.training")[step_name("actor")])})
    # a failure at the commit (rank 1), where the report's figures ride: every rank aborts
    snapshot = _state_bytes(rt)
    try:
        rt.transition("B", fault=(1, 0, "commit"))
        out["fault"] = "no error"
    except TransitionAborted as error:
        out["fault"] = str(error)
        out["failures"] = [(f.rank, f.round, f.op) for f in error.failures]
    out["after_fault"] = {"plan": rt.plan, "intact": _same(snapshot, _state_bytes(rt))}
    report = rt.transition("B")  # the runtime is still usable and its collectives in step
    out["retry"] = {"plan": rt.plan, "bytes_sent": report.bytes_sent,
                    "step": int(rt.state("actor.training")[step_name("actor")])}
    return out


@pytest.fixture(scope="module")
def per_rank():
    return spawn_ok(_run, 2)


def test_a_warm_transition_costs_one_agreement_per_round_and_the_commit(per_rank):
    for result in per_rank:
        for warm in result["warm"]:
            counts, rounds = warm["counts"], warm["rounds"]
            assert rounds >= 1
            # the first agreement's all_gather (flag + registrations + steps) and the commit's (flag + figures)
            assert counts.get("all_gather", 0) == 2, counts
            assert counts.get("all_reduce", 0) == rounds - 1, counts  # the other rounds' agreements
            assert sum(counts.values()) == rounds + 1, counts  # nothing else: no object gathers, no reductions


def test_report_fields_equal_values_computed_apart(per_rank):
    for k in range(len(per_rank[0]["warm"])):
        reports = [result["warm"][k]["report"] for result in per_rank]
        programs = [result["warm"][k]["program"] for result in per_rank]
        for rank, (report, program) in enumerate(zip(reports, programs)):
            assert report["rank"] == rank
            assert report["bytes_sent"] == program["send"] and report["bytes_received"] == program["recv"]
            assert report["bytes_copied"] + report["bytes_kept"] == program["copy"] + program["keep"]
            assert report["total_bytes_sent"] == sum(p["send"] for p in programs) > 0
            assert report["max_seconds"] == max(r["seconds"] for r in reports)
            assert sum(r["seconds"] for r in report["rounds"]) <= report["seconds"] <= report["wall_s"]
            assert report["compile_s"] == 0.0
        assert sum(r["bytes_sent"] for r in reports) == sum(r["bytes_received"] for r in reports)
    for result in per_rank:  # the Adam step survives every transition (it rides on the first agreement)
        assert [warm["step"] for warm in result["warm"]] == [STEP] * len(result["warm"])


def test_a_failure_at_the_commit_aborts_every_rank_with_the_same_error(per_rank):
    texts = {result["fault"] for result in per_rank}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "injected fault (commit)" in text and "rank 1, round" in text and "commit" in text
    for result in per_rank:
        assert result["failures"] == [(1, result["warm"][0]["rounds"], "commit")]
        assert result["after_fault"] == {"plan": "A", "intact": True}
        assert result["retry"]["plan"] == "B" and result["retry"]["step"] == STEP


def _run_registrations(rank, world):
    """Warm transitions of the training stage only; then rank 0 alone registers the
    generation stage (every rank must refuse to move without rank 1's shards), then rank 1
    does too (both stages move), then warm again."""
    module = ir.parse_source(SOURCE, "registrations.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world, direct_min_bytes=1024)
    gen = torch.Generator().manual_seed(5)
    full = {ms: {name: (torch.tensor(STEP, dtype=torch.int64) if name.endswith("#step")
                        else torch.randn(shape, generator=gen).to(dtype))
                 for name, (shape, dtype) in rt.tensor_specs(ms).items()} for ms in STAGES}
    rt.register("actor.training", rt.shard_state_dict("actor.training", full["actor.training"]))
    for target in ("B", "A", "B", "A"):  # the last ones warm: the agreement checks the registrations
        rt.transition(target)
    out = {}
    counts = _count_control(rt)
    if rank == 0:
        rt.register("actor.generation", rt.shard_state_dict("actor.generation", full["actor.generation"]))
    try:
        rt.transition("B")
        out["one_rank"] = "no error"
    except Exception as error:  # noqa: BLE001 - the test compares the texts of both ranks
        out["one_rank"] = f"{type(error).__name__}: {error}"
    out["plan_after_refusal"] = rt.plan
    if rank == 1:
        rt.register("actor.generation", rt.shard_state_dict("actor.generation", full["actor.generation"]))
    rt.transition("B")
    out["moved"] = {ms: all(torch.equal(rt.gather_state_dict(ms)[name], tensor) for name, tensor in full[ms].items())
                    for ms in STAGES}
    out["generation_keys"] = sorted(rt.state("actor.generation"))
    out["expected_keys"] = sorted(rt.shard_state_dict("actor.generation", full["actor.generation"]))
    rt.transition("A")  # the first B -> A under the new counts checks them by its own gather
    rt.transition("B")
    counts.clear()
    report = rt.transition("A")
    out["warm_counts"] = dict(counts)
    out["warm_rounds"] = len(report.rounds)
    return out


def test_a_registration_on_one_rank_between_transitions_is_honoured_on_every_rank():
    results = spawn(_run_registrations, 2)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    outs = [res[1] for res in results]
    refusals = {out["one_rank"] for out in outs}
    assert len(refusals) == 1, refusals  # the same error on every rank
    assert "rank 1 holds actor.generation" in refusals.pop()
    for out in outs:
        assert out["plan_after_refusal"] == "A"
        assert out["moved"] == {ms: True for ms in STAGES}
        assert out["generation_keys"] == out["expected_keys"] and out["generation_keys"]
        # warm again: no gather of its own before the first agreement
        assert out["warm_counts"].get("all_gather", 0) == 2 and "all_gather_object" not in out["warm_counts"]
        assert out["warm_counts"].get("all_reduce", 0) == out["warm_rounds"] - 1
