"""The embedding API with expert parallelism: a tiny Qwen3-MoE (4 experts, hidden 16)
changes plan between EP, TP and DP layouts on 4 gloo ranks, in fp32 and bf16. After
every transition each rank holds exactly the boxes the compiler's layout gives it (an
expert's tensors whole on its EP rank and on no other, optimizer state and step
included), byte for byte equal to the reference slices; the full state gathers back
bit-exact; the executor's replay verification passes."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.runtime import Runtime
from nereus.runtime.state import shard_of, step_name

from runtime_helpers import spawn

pytestmark = pytest.mark.multiprocess

WORLD = 4
STAGES = ("actor.generation", "actor.training")


def _source(dtype: str) -> str:
    return f"""
cluster cpu {{ nodes 1 gpus_per_node 4 gpu {{ mem 1GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 16GB }}
model actor = qwen3_moe {{ layers 2 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype {dtype}
                          experts 4 experts_per_token 2 expert_ffn 8 }}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 generation: actor training: actor }}
plan E2T2 {{ actor.generation dp 1 ep 2 tp 2 on 0..3
            actor.training   dp 1 ep 2 tp 2 on 3, 1, 0, 2 }}
plan T2 {{ actor.generation dp 2 tp 2 on 0..3
          actor.training   dp 1 tp 2 on 2, 3 }}
plan E4 {{ actor.generation dp 1 ep 4 on 0..3
          actor.training   dp 1 ep 4 on 0..3 }}
plan E2D2 {{ actor.generation dp 2 ep 2 on 3, 2, 1, 0
            actor.training   dp 2 ep 2 on 0..3 }}
plan E2P2 {{ actor.generation dp 1 ep 4 on 0..3
            actor.training   dp 1 ep 2 pp 2 on 0..3 }}
"""


CHAIN = ("T2", "E4", "E2D2", "E2T2", "E2P2", "T2")  # starting from E2T2: ep 2 -> tp 2 -> ep 4 -> ep 2 dp 2 -> ...


def _reference(rt: Runtime, ms: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, (shape, dtype) in rt.tensor_specs(ms).items():
        full[name] = torch.tensor(17, dtype=torch.int64) if name.endswith("#step") else \
            torch.randn(shape, generator=gen).to(dtype)
    return full


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check(rt: Runtime, refs: dict, module) -> list:
    """Mismatches between this rank's state and the reference slices of the current plan,
    and any expert tensor held by a rank that is not its expert's EP rank."""
    bad = []
    for ms, full in refs.items():
        local = rt.state(ms)
        unit = next((u for u in rt.layout(ms) if rt.rank in u["gpus"]), None)
        expected = {} if unit is None else {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == rt.rank}
        names = set(local) - {step_name("actor")}
        if names != set(expected):
            bad.append((ms, "names"))
            continue
        for name, boxes in expected.items():
            if not _same(local[name], shard_of(full[name], boxes)):
                bad.append((ms, name))
        placement = module.plan(rt.plan).placement(ms)
        if unit is not None:
            index = placement.gpus.index(rt.rank)
            ep_rank = (index // placement.tp) % placement.ep
            per = 4 // placement.ep
            held = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
            if held != set(range(ep_rank * per, (ep_rank + 1) * per)):
                bad.append((ms, "experts", sorted(held), ep_rank))
            if ms.endswith(".training") and int(local.get(step_name("actor"), -1)) != 17:
                bad.append((ms, "step"))
    return bad


def _chain(rank, world, dtype):
    module = ir.parse_source(_source(dtype), "moe.nir")
    rt = Runtime(module, "E2T2", rank=rank, world_size=world, verify=True, direct_min_bytes=256)
    refs = {ms: _reference(rt, ms, seed=i) for i, ms in enumerate(STAGES)}
    for ms, full in refs.items():
        rt.register(ms, rt.shard_state_dict(ms, full))
    out = {"initial": _check(rt, refs, module), "steps": []}
    for target in CHAIN:
        report = rt.transition(target)
        gathered = {ms: rt.gather_state_dict(ms) for ms in STAGES}
        out["steps"].append({
            "target": target, "bad": _check(rt, refs, module), "verified": report.verified,
            "sent": report.total_bytes_sent,
            "gather_ok": all(_same(gathered[ms][n], refs[ms][n]) for ms in STAGES for n in refs[ms]),
        })
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ep_tp_dp_transitions_are_byte_exact(dtype):
    results = spawn(_chain, WORLD, dtype)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    ranks = [res[1] for res in results]
    for rank, result in enumerate(ranks):
        assert result["initial"] == [], (rank, result["initial"])
        assert [s["target"] for s in result["steps"]] == list(CHAIN)
        for step in result["steps"]:
            assert step["bad"] == [] and step["verified"] is True and step["gather_ok"], (rank, step)
    assert all(step["sent"] > 0 for step in ranks[0]["steps"])


def test_a_runtime_starts_in_an_expert_parallel_plan():
    """The runtime's plan check accepts ep > 1 (it refused it before the EP runtime)."""
    from nereus.runtime.runtime import known_plan

    module = ir.parse_source(_source("fp32"), "moe.nir")
    for plan in module.plans:
        known_plan(module, plan.name)
