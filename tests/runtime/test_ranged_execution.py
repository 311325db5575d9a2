"""A v2 part lowered as ranges (nereus.runtime.pieces) moves the same bytes into the same
places as its v1 expansion lowered member by member: on 2 gloo ranks, for expert-parallel
and dense changes (EP -> TP and DP, an uneven pipeline split, ZeRO 1 and 3 with uneven
row chunks, offloaded units on either side), every after-shard of both executions is
byte for byte the reference slice. The v2 program runs three ways: with the default
chunks, with 512-byte chunks and 64-byte direct pieces (runs of a range cut across
chunks, ranged direct pieces as ops of their own), and a second time with checksums
verified, when its copies and chunks run as replays built from ranged tables (the Triton
kernels forced under the interpreter; tables built with tensor ops from 2 tensors on)."""

from __future__ import annotations

import pytest
import torch

from runtime_helpers import spawn_ok

pytestmark = pytest.mark.multiprocess

MOE = ("qwen3_moe { layers 3 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype bf16 experts 8 "
       "experts_per_token 2 expert_ffn 8 }")
LLAMA = "llama { layers 3 hidden 20 heads 4 kv_heads 2 ffn 36 vocab 64 dtype bf16 }"
ODD = "llama { layers 3 hidden 20 heads 4 kv_heads 2 ffn 36 vocab 51 dtype bf16 }"  # 51 rows: uneven ZeRO chunks
CASES = [
    ("moe gen ep2 -> tp2", MOE, "generation", "dp 1 ep 2 on 0..1", "dp 1 tp 2 on 0..1"),
    ("moe train ep2 -> dp2", MOE, "training", "dp 1 ep 2 on 0..1", "dp 2 on 0..1"),
    ("moe train tp2 offload -> ep2", MOE, "training", "dp 1 tp 2 on 0..1 offload", "dp 1 ep 2 on 0..1"),
    ("moe train ep2 -> pp2 (3 layers)", MOE, "training", "dp 1 ep 2 on 0..1", "dp 1 pp 2 on 1, 0"),
    ("llama train tp2 -> dp2", LLAMA, "training", "dp 1 tp 2 on 0..1", "dp 2 on 0..1"),
    ("llama zero 1 dp2 -> pp2", ODD, "training", "dp 2 on 0..1 zero 1", "dp 1 pp 2 on 1, 0"),
    ("llama zero 3 dp2 -> dp1 offload", ODD, "training", "dp 2 on 0..1 zero 3", "dp 1 on 1 offload"),
]


def _module(model: str, stage: str, before: str, after: str):
    import nereus.ir as ir

    return ir.parse_source(f"""
cluster c {{ nodes 1 gpus_per_node 2 gpu {{ mem 1GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 16GB }}
model actor = {model}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 {stage}: actor }}
plan A {{ actor.{stage} {before} }}
plan B {{ actor.{stage} {after} }}
""", "ranged.nir")


def _full(tensors: list) -> dict:
    """Distinct values per tensor (any misplaced element shows), by the v1 names."""
    gen = torch.Generator().manual_seed(5)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    return {t["name"]: torch.randn(t["shape"], generator=gen).to(dtypes[t["dtype"]]) for t in tensors}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _run(rank, world):
    import torch.distributed as dist

    from nereus.backends.rank_json import rank_program_json
    from nereus.ir.program import expand_ranges
    from nereus.passes import compile_transition
    from nereus.runtime import replay
    from nereus.runtime.executor import execute
    from nereus.runtime.execution_plan import plan_for
    from nereus.runtime.program import part_facts, rank_program
    from nereus.runtime.state import shard_of, shard_unit

    assert replay.packer_for(torch.device("cpu")) is not None  # the kernels replay here (interpreted)
    from nereus.backends.triton import replay as tables

    tables.TABLE_MIN_BOXES = 2  # these ranges are short: build their replays' tables with tensor ops all the same
    control = dist.new_group(backend="gloo")
    out = {}
    for name, model, stage, before_plan, after_plan in CASES:
        part = rank_program_json(compile_transition(_module(model, stage, before_plan, after_plan), "A", "B"), rank)
        v1 = expand_ranges(part)
        full = _full(v1["tensors"])
        offloaded = part_facts(part, rank).offloaded
        want = {(u["id"], s["tensor"]): shard_of(full[s["tensor"]], s["boxes"])
                for u in v1["units"]["after"] for s in u["shards"] if s["gpu"] == rank}

        def run(prog, **options):
            before = {u["id"]: shard_unit(u, rank, full) for u in v1["units"]["before"] if rank in u["gpus"]}
            result = execute(prog, before, group=None, control=control, device=torch.device("cpu"),
                             offloaded=offloaded, **options)
            got = {(unit, tensor): t for unit, shards in result.state.items() for tensor, t in shards.items()}
            wrong = sorted(str(k) for k in set(got) | set(want)
                           if k not in got or k not in want or not torch.equal(_bytes(got[k]), _bytes(want[k])))
            return {"wrong": wrong, "tensors": len(got), "sent": result.sent_bytes, "verified": result.verified}

        ranged = rank_program(part, rank)
        results = {"v1": run(rank_program(v1, rank)), "v2": run(ranged),
                   "v2 small chunks": run(rank_program(part, rank, direct_min_bytes=64), chunk_bytes=512),
                   "v2 again": run(ranged, verify=True)}
        results["ranged"] = sum(p.count > 1 for w in ranged.rounds for m in w.sends + w.recvs for p in m.pieces) + \
            sum(p.count > 1 for w in ranged.rounds for p in w.copies)
        results["replays"] = sorted({key[0] for key in plan_for(ranged, 128 << 20).launches
                                     if key[0] in ("copy", "send", "recv")})
        out[name] = results
    return out


def test_ranges_move_what_their_expansion_moves(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("NEREUS_PACK_BACKEND", "triton")
    monkeypatch.setenv("NEREUS_PACK_JIT", "eager")
    per_rank = spawn_ok(_run, 2)
    ranged = replayed = 0
    for rank, cases in enumerate(per_rank):
        for name, results in cases.items():
            for how in ("v1", "v2", "v2 small chunks", "v2 again"):
                assert results[how]["wrong"] == [], (rank, name, how)
                assert (results[how]["tensors"], results[how]["sent"]) == \
                    (results["v1"]["tensors"], results["v1"]["sent"]), (rank, name, how)
            assert results["v2 again"]["verified"] is True, (rank, name)
            ranged += results["ranged"]
            replayed += bool(results["replays"])
    assert ranged > 20  # pieces of several tensors did the moving ...
    assert replayed > 5  # ... and replays built from ranged tables ran
