"""A warm transition's fixed host cost, on 2 gloo ranks: the control-group collectives
are counted (one all_gather for the registrations and Adam steps, one agreement per
round, the commit's all_gather that also carries the report's figures), the report's
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

from runtime_helpers import spawn

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
        prog = rt._lowered[key][1]
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
    results = spawn(_run, 2)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


def test_a_warm_transition_costs_one_gather_one_agreement_per_round_and_the_commit(per_rank):
    for result in per_rank:
        for warm in result["warm"]:
            counts, rounds = warm["counts"], warm["rounds"]
            # _live_stages' all_gather (registrations + steps) and the commit's all_gather (flag + figures)
            assert counts.get("all_gather", 0) == 2, counts
            assert counts.get("all_reduce", 0) == rounds, counts  # one agreement per round
            assert sum(counts.values()) == rounds + 2, counts  # nothing else: no object gathers, no reductions


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
    for result in per_rank:  # the Adam step survives every transition (it rides on _live_stages' gather)
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
