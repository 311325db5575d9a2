"""The embedding API on compiled programs: a chain of random plan changes of a small GQA
llama actor + critic (TP, PP and DP up and down, Split/Merge/Extend/Destroy, colocated)
on 4 gloo ranks. After every transition each rank's shards equal the reference full
tensors' slices byte for byte (optimizer state and step included), ranks without a unit
hold nothing, peak bytes stay within the compiler's replay, and an injected failure
leaves every rank's old state intact and raises on every rank."""

from __future__ import annotations

import random

import pytest
import torch

import nereus.ir as ir
from nereus.ir.diagnostics import NereusError
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.verify import verify_program
from nereus.runtime import Runtime, TransitionAborted
from nereus.runtime.state import shard_of, step_name

from runtime_helpers import spawn

pytestmark = pytest.mark.multiprocess

WORLD = 4
HEADER = """
cluster cpu {
  nodes 1
  gpus_per_node 4
  gpu { mem 5MB  flops 1TFLOPS  hbm 100GB/s }  # tight: the compiler needs several rounds
  intra 10GB/s
  inter 1GB/s
  host_mem 16GB
}
model actor  = llama { layers 4 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 128 }
model critic = actor { head value }
workload ppo {
  batch 4  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor, critic
}
"""
STAGES = ("actor.generation", "actor.training", "critic.training")
# (dp, tp, pp) per model-stage along the chain; GPU sets are drawn at random
MESHES = [
    {"actor.generation": (2, 2, 1), "actor.training": (1, 2, 2), "critic.training": (2, 2, 1)},
    {"actor.generation": (2, 2, 1), "actor.training": (1, 4, 1), "critic.training": (1, 2, 2)},  # tp up, pp down, merge
    {"actor.generation": (4, 1, 1), "actor.training": (2, 1, 2), "critic.training": (1, 1, 1)},  # dp up, pp up, destroy
    {"actor.generation": (1, 2, 1), "actor.training": (1, 1, 4), "critic.training": (2, 1, 1)},  # dp down, extend
    {"actor.generation": (1, 4, 1), "actor.training": (2, 2, 1), "critic.training": (1, 4, 1)},  # split, tp up
]


def _source(seed: int) -> str:
    rng = random.Random(seed)
    lines = [HEADER]
    for k, mesh in enumerate(MESHES):
        lines.append(f"plan S{k} {{")
        for ms in STAGES:
            dp, tp, pp = mesh[ms]
            gpus = rng.sample(range(WORLD), dp * tp * pp)
            lines.append(f"  {ms} dp {dp} tp {tp} pp {pp} on {', '.join(map(str, gpus))}")
        lines.append("}")
    return "\n".join(lines)


def _reference(rt: Runtime, ms: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, (shape, dtype) in rt.tensor_specs(ms).items():
        if name.endswith("#step"):
            full[name] = torch.tensor(17, dtype=torch.int64)
        else:
            full[name] = torch.randn(shape, generator=gen).to(dtype)
    return full


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check(rt: Runtime, refs: dict) -> list:
    """Mismatches between this rank's state and the reference slices of the current plan."""
    bad = []
    for ms, full in refs.items():
        local = rt.state(ms)
        unit = next((u for u in rt.layout(ms) if rt.rank in u["gpus"]), None)
        expected = {} if unit is None else {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == rt.rank}
        step = step_name(ms.split(".")[0])
        if unit is not None and ms.endswith(".training"):
            if step not in local or int(local[step]) != 17:
                bad.append((ms, "step"))
        names = set(local) - {step}
        if names != set(expected):
            bad.append((ms, "names", len(names), len(expected)))
            continue
        for name, boxes in expected.items():
            if not _same(local[name], shard_of(full[name], boxes)):
                bad.append((ms, name))
    return bad


def _chain(rank, world, source, fault):
    module = ir.parse_source(source, "chain.nir")
    # direct_min_bytes=4096: the larger pieces travel in place, the smaller ones packed
    rt = Runtime(module, "S0", rank=rank, world_size=world, verify=True, direct_min_bytes=4096)
    refs = {ms: _reference(rt, ms, seed=i) for i, ms in enumerate(STAGES)}
    for ms, full in refs.items():
        rt.register(ms, rt.shard_state_dict(ms, full))
    out = {"initial": _check(rt, refs), "steps": [], "errors": []}
    for attempt in (lambda: rt.transition("S9"), lambda: rt.register("actor.training", {"actor/embed.weight": 0}),
                    lambda: rt.state("actor.inference")):
        try:
            attempt()
            out["errors"].append("no error")
        except NereusError as error:
            out["errors"].append(error.message)
    for k in range(1, len(MESHES)):
        target = f"S{k}"
        if fault is not None and k == 2:
            before_plan = rt.plan
            try:
                rt.transition(target, fault=fault)
                out["fault"] = "no error"
            except TransitionAborted as error:
                out["fault"] = str(error)
            out["after_fault"] = {"plan": rt.plan == before_plan, "bad": _check(rt, refs)}
        program, _ = rt.compile(target)  # this rank's part; the replay needs the whole program
        whole = program_json(compile_transition(module, rt.plan, target))
        replay = verify_program(whole).peak_bytes.get(rank, 0)
        report = rt.transition(target)
        gathered = rt.gather_state_dict("actor.training")
        out["steps"].append({
            "target": target, "bad": _check(rt, refs), "held": {ms: len(rt.state(ms)) for ms in STAGES},
            "peak": report.peak_bytes, "replay": replay, "verified": report.verified,
            "gather_ok": all(_same(gathered[n], refs["actor.training"][n]) for n in refs["actor.training"]),
            "sent": report.bytes_sent, "rounds": len(report.rounds), "compiled_rounds": len(program["rounds"]),
            "pack_backend": report.pack_backend,
        })
    return out


@pytest.fixture(scope="module")
def chain():
    results = spawn(_chain, WORLD, _source(seed=3), (2, 0, "unpack"))
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


def test_every_rank_holds_exactly_its_new_shards_after_each_transition(chain):
    assert all(rank["initial"] == [] for rank in chain)
    for rank, result in enumerate(chain):
        assert len(result["steps"]) == len(MESHES) - 1
        for step in result["steps"]:
            assert step["bad"] == [], (rank, step)
            assert step["verified"] is True
            assert step["gather_ok"], (rank, step["target"])
    assert sum(step["sent"] for rank in chain for step in rank["steps"]) > 0
    assert max(step["rounds"] for step in chain[0]["steps"]) > 1  # memory forces several rounds
    assert all(step["rounds"] == step["compiled_rounds"] for rank in chain for step in rank["steps"])


def test_reports_name_the_pack_backend_that_ran(chain):
    # CPU tensors over gloo: the torch copy_ path, whether or not Triton is installed
    assert {step["pack_backend"] for rank in chain for step in rank["steps"]} == {"torch"}


def test_a_rank_without_a_unit_holds_nothing(chain):
    # S2 places critic.training on one GPU only: three ranks hold nothing of it
    empty = [rank["steps"][1]["held"]["critic.training"] == 0 for rank in chain]
    assert sum(empty) == WORLD - 1


def test_peak_bytes_stay_within_the_compilers_replay(chain):
    for rank, result in enumerate(chain):
        for step in result["steps"]:
            assert 0 < step["peak"] <= step["replay"], (rank, step)


def test_an_injected_failure_rolls_back_every_rank(chain):
    for rank, result in enumerate(chain):
        assert "rank 2, round 0" in result["fault"], (rank, result["fault"])
        assert result["after_fault"] == {"plan": True, "bad": []}, rank


def test_user_errors_are_nereus_errors_that_leave_the_runtime_usable(chain):
    for result in chain:
        unknown_plan, bad_register, unknown_stage = result["errors"]
        assert unknown_plan == "unknown plan 'S9'"
        assert "missing" in bad_register
        assert unknown_stage == "unknown model-stage 'actor.inference'"
