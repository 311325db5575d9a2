"""Host work per piece in expert-parallel transitions: the lowering moves an expert's
whole tensor as one piece (not one per fused part), and the torch pack path copies a
chunk's pieces in grouped calls, byte for byte as the per-piece copies did."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.runtime import packing, program
from nereus.runtime.program import rank_program

EXPERTS = 8


def _module(after: str):
    return ir.parse_source(f"""
cluster cpu {{ nodes 1 gpus_per_node 2 gpu {{ mem 1GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 16GB }}
model actor = qwen3_moe {{ layers 2 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype bf16
                          experts {EXPERTS} experts_per_token 2 expert_ffn 8 }}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 training: actor }}
plan A {{ actor.training dp 1 ep 2 on 0..1 }}
plan B {{ actor.training {after} on 0..1 }}
""", "pieces.nir")


def _received(after: str, gpu: int = 1) -> list:
    """[(tensor, piece)] of what `gpu` receives, a piece once per tensor it moves."""
    module = _module(after)
    prog = rank_program(program_json(compile_transition(module, "A", "B")), gpu)
    return program.members_of(p for w in prog.rounds for m in w.recvs for p in m.pieces)


def test_an_expert_moving_whole_travels_as_one_piece_per_tensor():
    pieces = _received("dp 2")
    experts = [(name, p) for name, p in pieces if ".experts." in name]
    # GPU 1 gets the other EP rank's 4 experts of each of 2 layers: gate_up and down, in
    # bf16 plus fp32 master, exp_avg, exp_avg_sq: 4 x 2 x 2 x 4 tensors, one piece each
    assert len(experts) == (EXPERTS // 2) * 2 * 2 * 4
    assert len({(name, p.dst_unit) for name, p in experts}) == len(experts)
    gate_up = next(p for name, p in experts if name.endswith("experts.0.gate_up.weight"))
    assert gate_up.src_slices == (slice(0, 16), slice(0, 16)) and gate_up.dst_slices == gate_up.src_slices


def test_the_halves_of_a_split_expert_travel_as_two_2d_pieces_by_default():
    # the default (JOIN_PARTS off): the gate half and the up half are two row blocks, each
    # a 2-D piece that the fused pack moves as one strided box
    assert not program.JOIN_PARTS
    pieces = [p for name, p in _received("dp 1 tp 2") if name == "actor/layers.0.mlp.experts.0.gate_up.weight"]
    assert [(p.parts, p.src_slices, p.dst_slices) for p in pieces] == [
        (1, (slice(4, 8), slice(0, 16)), (slice(0, 4), slice(0, 16))),
        (1, (slice(12, 16), slice(0, 16)), (slice(4, 8), slice(0, 16)))]


def test_the_halves_of_a_split_expert_travel_as_one_two_part_piece(monkeypatch):
    monkeypatch.setattr(program, "JOIN_PARTS", True)
    # ep 2 -> tp 2: GPU 1 gets the gate half and the up half of each of GPU 0's experts:
    # rows 4:8 and 12:16 of the source (not adjacent), rows 0:4 and 4:8 of its shard: one
    # piece of 2 parts, 8 source rows and 4 destination rows apart
    pieces = [p for name, p in _received("dp 1 tp 2") if name == "actor/layers.0.mlp.experts.0.gate_up.weight"]
    assert len(pieces) == 1
    (piece,) = pieces
    assert (piece.parts, piece.src_step, piece.dst_step) == (2, 8, 4)
    assert piece.src_slices == (slice(4, 8), slice(0, 16)) and piece.dst_slices == (slice(0, 4), slice(0, 16))
    assert piece.numel == 2 * 4 * 16 and not piece.direct


def test_a_two_part_view_reads_both_parts():
    from nereus.runtime.wires import piece_region

    source = torch.arange(16 * 3).reshape(16, 3)
    view = piece_region(source, (slice(4, 8), slice(0, 3)), False, 2, 8)
    assert torch.equal(view, torch.stack([source[4:8], source[12:16]], dim=1))  # rows first: streams cut rows
    target = torch.zeros(8, 3, dtype=source.dtype)
    piece_region(target, (slice(0, 4), slice(0, 3)), False, 2, 4).copy_(view)
    assert torch.equal(target, torch.cat([source[4:8], source[12:16]]))


def _views():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 10, generator=gen)
    return [base[1:4], base[:, 2:5], torch.randn(3, 3, generator=gen).to(torch.bfloat16),
            torch.tensor(7, dtype=torch.int64), base.t()[2:4], torch.randn(0, 4, generator=gen),
            torch.randn(5, generator=gen).to(torch.float16), base[0]]


@pytest.mark.parametrize("fn", ["torch_pack", "pack"])
@pytest.mark.parametrize("repeat", [1, 6])  # 6: lists of 16 or more pieces take _foreach_copy_
def test_grouped_pack_and_unpack_match_the_per_piece_copies(fn, repeat):
    views = _views() * repeat
    assert repeat == 1 or sum(v.dtype == torch.float32 and v.is_contiguous() for v in views) >= \
        packing.FOREACH_MIN_PIECES
    offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
    expected = torch.zeros(total, dtype=torch.uint8)
    for view, offset in zip(views, offsets):
        n = view.numel() * view.element_size()
        expected[offset:offset + n] = view.contiguous().reshape(-1).view(torch.uint8)
    buffer = torch.full((total,), 255, dtype=torch.uint8)
    getattr(packing, fn)(views, offsets, total, out=buffer)
    got = torch.cat([buffer[o:o + v.numel() * v.element_size()] for v, o in zip(views, offsets)])
    want = torch.cat([expected[o:o + v.numel() * v.element_size()] for v, o in zip(views, offsets)])
    assert torch.equal(got, want)
    targets = [torch.empty_like(v) for v in views]
    packing.torch_unpack(buffer, targets, offsets)
    for target, view in zip(targets, views):
        assert torch.equal(target, view)
    # into strided destinations too (a receiver's column slices)
    if repeat > 1:
        return
    wide = torch.zeros(6, 10)
    packing.torch_unpack(buffer[offsets[1]:], [wide[:, 2:5]], [0])
    assert torch.equal(wide[:, 2:5], views[1])


def test_prepare_warms_the_views_the_executor_packs(monkeypatch):
    monkeypatch.setattr(program, "JOIN_PARTS", True)
    # the pack kernels are compiled ahead for these views: two-part pieces as [rows, 2, ...]
    from nereus.runtime.prepare import stream_views
    from nereus.runtime.wires import TORCH_DTYPES

    module = _module("dp 1 tp 2")
    prog = rank_program(program_json(compile_transition(module, "A", "B")), 0)
    views = [v for _, vs, _ in stream_views(prog, TORCH_DTYPES) for v in vs]
    two_part = [p for w in prog.rounds for m in w.sends for p in m.pieces if p.parts == 2]
    assert two_part and sum(v.dim() == 3 and v.shape[1] == 2 for v in views) >= sum(p.count for p in two_part)
    sent = sum(p.total_bytes for w in prog.rounds for m in w.sends for p in m.pieces)
    received = sum(p.total_bytes for w in prog.rounds for m in w.recvs for p in m.pieces)
    assert sum(v.numel() * v.element_size() for v in views) == sent + received
