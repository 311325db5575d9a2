"""The views the executor takes from the execution plan (wires.Region, streams.plan_chunks
with PeerStream.planned) are the views it sliced on every call before: the same memory,
shapes and strides for every piece of compiled llama and MoE programs (two-part pieces
included), on tensors that start at a storage offset. One process."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.runtime import execution_plan, program, streams
from nereus.runtime.program import rank_program
from nereus.runtime.wires import TORCH_DTYPES, dst_region, src_region

CHUNKS = (512, 4096, 128 << 20)  # many chunks per stream, a few, one


def _module(model: str, before: str, after: str):
    return ir.parse_source(f"""
cluster c {{ nodes 1 gpus_per_node 4 gpu {{ mem 4GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 16GB }}
model actor = {model}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 training: actor }}
plan A {{ actor.training {before} }}
plan B {{ actor.training {after} }}
""", "views.nir")


LLAMA = "llama { layers 2 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 dtype bf16 }"
MOE = ("qwen3_moe { layers 2 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype bf16 "
       "experts 8 experts_per_token 2 expert_ffn 8 }")
CASES = [(LLAMA, "dp 1 tp 2 on 0..1", "dp 2 on 0..1"),  # both ways, dim-1 slices
         (LLAMA, "dp 1 tp 1 on 0", "dp 1 tp 4 on 0..3"),
         (LLAMA, "dp 1 pp 2 on 0..1", "dp 1 tp 2 on 2..3"),
         (MOE, "dp 1 ep 2 on 0..1", "dp 1 tp 2 on 0..1")]


def _programs(join_parts: bool):
    for model, before, after in CASES:
        compiled = program_json(compile_transition(_module(model, f"{before}", f"{after}"), "A", "B"))
        for gpu in range(4):
            yield rank_program(compiled, gpu, direct_min_bytes=1024)


def _offset(info) -> torch.Tensor:
    """A contiguous tensor of the shard's shape that starts 3 elements into its storage."""
    numel = 1
    for d in info.shape:
        numel *= d
    flat = torch.arange(numel + 3, dtype=torch.float64).to(TORCH_DTYPES[info.dtype])
    return flat[3:].view(tuple(info.shape))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype) == (b.data_ptr(), tuple(b.shape), b.stride(), b.dtype)


@pytest.mark.parametrize("join_parts", [False, True])
def test_planned_regions_are_the_sliced_views(monkeypatch, join_parts):
    monkeypatch.setattr(program, "JOIN_PARTS", join_parts)
    checked = parts = 0
    for prog in _programs(join_parts):
        before = {(u, n): _offset(i) for u, shards in prog.before.items() for n, i in shards.items()}
        after = {(u, n): _offset(i) for u, shards in prog.after.items() for n, i in shards.items()}
        plan = execution_plan.build_plan(prog, 4096)
        for work, planned in zip(prog.rounds, plan.rounds):
            for msgs, regions, side in ((work.sends, planned.send_regions, "src"),
                                        (work.recvs, planned.recv_regions, "dst")):
                for msg, per_piece in zip(msgs, regions):
                    for p, r in zip(msg.pieces, per_piece):
                        for name in p.tensors:
                            if side == "src":
                                tensor = before[(p.src_unit, name)]
                                assert _same(r.view(tensor), src_region(p, tensor))
                            else:
                                tensor = after[(p.dst_unit, name)]
                                assert _same(r.view(tensor), dst_region(p, tensor))
                            checked += 1
                            parts += p.parts > 1
            for p, (src, dst) in zip(work.copies, planned.copy_regions):
                for name in p.tensors:
                    assert _same(src.view(before[(p.src_unit, name)]), src_region(p, before[(p.src_unit, name)]))
                    assert _same(dst.view(after[(p.dst_unit, name)]), dst_region(p, after[(p.dst_unit, name)]))
                    checked += 1
    assert checked > 100 and (parts > 0) == join_parts  # two-part pieces where joined


def _chunks(stream) -> list:
    chunks = [stream.chunk(k) for k in range(len(stream.chunks))]  # a planned stream takes its views here
    return [([(v.data_ptr(), tuple(v.shape), v.stride()) for v in c.views], c.offsets, c.nbytes, c.fused, c.crossing,
             None if c.wire is None else (c.wire.data_ptr(), c.wire.numel())) for c in chunks]


@pytest.mark.parametrize("chunk_bytes", CHUNKS)
@pytest.mark.parametrize("join_parts", [False, True])
def test_planned_streams_are_the_streams_cut_from_the_views(monkeypatch, chunk_bytes, join_parts):
    monkeypatch.setattr(program, "JOIN_PARTS", join_parts)
    streams_checked = 0
    for prog in _programs(join_parts):
        before = {(u, n): _offset(i) for u, shards in prog.before.items() for n, i in shards.items()}
        after = {(u, n): _offset(i) for u, shards in prog.after.items() for n, i in shards.items()}
        plan = execution_plan.build_plan(prog, chunk_bytes)
        for work, planned in zip(prog.rounds, plan.rounds):
            for msgs, flags, plans, side in ((work.sends, planned.send_in_stream, planned.send_streams, "src"),
                                             (work.recvs, planned.recv_in_stream, planned.recv_streams, "dst")):
                views: dict = {}  # what the executor streamed before the plan: the sliced packed views
                for msg, in_stream in zip(msgs, flags):
                    for p, streamed in zip(msg.pieces, in_stream):
                        for name in p.tensors if streamed else ():
                            view = src_region(p, before[(p.src_unit, name)]) if side == "src" else \
                                dst_region(p, after[(p.dst_unit, name)])
                            views.setdefault(msg.peer, []).append(view)
                expected = [streams.PeerStream(peer, v, "cpu", chunk_bytes, 2) for peer, v in views.items()]
                expected = [s for s in expected if s.chunks]
                tensor_of = (lambda p, name: before[(p.src_unit, name)]) if side == "src" else \
                    (lambda p, name: after[(p.dst_unit, name)])
                got = [streams.PeerStream.planned(sp.peer, sp.chunks, [tensor_of(p, n) for p, n in sp.members()], "cpu",
                                                  2) for sp in plans]
                assert [s.peer for s in got] == [s.peer for s in expected]
                for g, e in zip(got, expected):
                    assert all(c.views is None for c in g.chunks)  # taken when the exchange reaches them
                    assert _chunks(g) == _chunks(e)
                    assert [s.numel() for s in g.slots] == [s.numel() for s in e.slots]
                    streams_checked += 1
    assert streams_checked > 10
