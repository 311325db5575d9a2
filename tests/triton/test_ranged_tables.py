"""Piece tables built with tensor ops for boxes that repeat over many tensors (a v2
range's members: nereus.backends.triton.segments.pieces_table, replay.message_table,
replay.copy_table) hold the pieces the per-box Python path gives, row for row, for any
address residues; their launches are the same; and a ranged pack/unpack replay moves
the bytes torch slicing moves."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nereus.backends.triton import replay
from nereus.backends.triton.segments import Piece, byte_runs, normalize_pair, pieces_table
from nereus.backends.triton.tables import build_launches, launch_classes

BOXES = [  # (shape, stride, element bytes): rows of a wider tensor, a dim-1 slice, 3-D, strided last dim
    ((4, 6), (6, 1), 2), ((3, 5), (12, 1), 4), ((2, 3, 4), (40, 8, 1), 2), ((5, 3), (9, 3), 1), ((7,), (1,), 8),
    ((1, 16), (64, 1), 2), ((6, 1), (4, 1), 4),
]


def _table(pieces) -> torch.Tensor:
    """Pieces (a list, or already a table) as a table."""
    if isinstance(pieces, torch.Tensor):
        return pieces
    return torch.tensor(pieces, dtype=torch.int64).view(-1, len(Piece._fields))


def _dense(shape) -> tuple:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return tuple(strides)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BOXES), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20)), min_size=1,
                                         max_size=6))
def test_pieces_table_is_normalize_pair_box_by_box(box, addresses):
    shape, stride, elem = box
    dense = _dense(shape)
    expected = [p for i, (a, b) in enumerate(addresses)
                for p in normalize_pair(shape, stride, dense, a, b, elem, msg=i % 3, slot=i)]
    src = torch.tensor([a for a, _ in addresses], dtype=torch.int64)
    dst = torch.tensor([b for _, b in addresses], dtype=torch.int64)
    got = pieces_table(byte_runs(shape, stride, dense, elem), src, dst, torch.arange(len(addresses)) % 3,
                       torch.arange(len(addresses)))
    assert torch.equal(got, _table(expected))


@pytest.mark.parametrize("kind", ["pack", "unpack"])
def test_message_table_is_message_pieces_of_each_member(kind):
    rng = random.Random(7)
    for _ in range(20):
        entries, expanded, slot, at = [], [], 1, 0
        for shape, stride, elem in rng.sample(BOXES, 3):
            count, offset = rng.choice([1, 3, replay.TABLE_MIN_BOXES, 13]), rng.randint(0, 40)
            spacing = -(-elem * torch.Size(shape).numel() // 8) * 8
            box = replay.Box(slot, shape, stride, offset, elem)
            entries.append((box, 0, at, count, spacing))
            expanded += [(replay.Box(slot + k, shape, stride, offset, elem), 0, at + k * spacing) for k in range(count)]
            slot, at = slot + count, at + count * spacing
        residues = tuple(rng.randrange(0, 16) for _ in range(slot))
        table = replay.message_table(kind, entries, residues)
        assert isinstance(table, torch.Tensor) == any(e[3] >= replay.TABLE_MIN_BOXES for e in entries)
        assert torch.equal(_table(table), _table(replay.message_pieces(kind, expanded, residues)))
        rel = "dst" if kind == "pack" else "src"
        for a, b in zip(build_launches(table, 0, rel), build_launches(replay.message_pieces(kind, expanded, residues),
                                                                        0, rel)):
            assert (a.word, a.vec, a.rows, a.cols) == (b.word, b.vec, b.rows, b.cols)
            assert torch.equal(a.segments, b.segments) and torch.equal(a.tiles, b.tiles)
        assert launch_classes(table) == launch_classes(replay.message_pieces(kind, expanded, residues))


def test_copy_table_is_copy_pieces_of_each_pair():
    rng = random.Random(3)
    entries, pairs, f = [], [], 0
    for i, (shape, stride, elem) in enumerate(BOXES):
        count = replay.TABLE_MIN_BOXES + 1 if i == 0 else rng.choice([1, 2, replay.TABLE_MIN_BOXES + 1])
        src = replay.Box(2 * f, shape, stride, rng.randint(0, 9), elem)
        dst = replay.Box(2 * f + 1, shape, _dense(shape), rng.randint(0, 9), elem)  # into a contiguous box
        entries.append((src, dst, count, 2))
        pairs += [(replay.Box(src.slot + 2 * k, shape, src.stride, src.offset, elem),
                   replay.Box(dst.slot + 2 * k, shape, dst.stride, dst.offset, elem)) for k in range(count)]
        f += count
    residues = tuple(rng.randrange(0, 16) for _ in range(2 * f))
    table = replay.copy_table(entries, residues)
    assert isinstance(table, torch.Tensor)
    assert torch.equal(table, _table(replay.copy_pieces(pairs, residues)))


def test_a_ranged_pack_and_unpack_move_what_slicing_moves():
    count, shape, stride, offset = replay.TABLE_MIN_BOXES + 3, (3, 4), (8, 1), 2  # columns 2..5 of [3, 8] bf16
    tensors = [torch.randn(3, 8).to(torch.bfloat16) for _ in range(count)]
    spacing = 24  # each region's 3 x 4 x 2 bytes, a multiple of the stream's 8-byte alignment
    buffer = torch.zeros(16 + count * spacing, dtype=torch.uint8)
    at = 16
    slots = [buffer] + tensors
    addresses = [t.data_ptr() for t in slots]
    residues = replay.residues(addresses)
    entries = [(replay.Box(1, shape, stride, offset, 2), 0, at, count, spacing)]
    assert isinstance(replay.message_table("pack", entries, replay.residues(addresses)), torch.Tensor)
    replay.Replay("pack", replay.message_table("pack", entries, residues), torch.device("cpu"),
                  tile=(2, 16)).run(replay.table(addresses, torch.device("cpu")))
    for k, t in enumerate(tensors):
        got = buffer[at + k * spacing: at + k * spacing + 24].view(torch.bfloat16).view(3, 4)
        assert torch.equal(got, t[:, 2:6])
    targets = [torch.zeros(3, 8, dtype=torch.bfloat16) for _ in range(count)]
    addresses = [buffer.data_ptr()] + [t.data_ptr() for t in targets]
    replay.Replay("unpack", replay.message_table("unpack", entries, replay.residues(addresses)),
                  torch.device("cpu"), tile=(2, 16)).run(replay.table(addresses, torch.device("cpu")))
    for t, target in zip(tensors, targets):
        assert torch.equal(target[:, 2:6], t[:, 2:6]) and not target[:, :2].any() and not target[:, 6:].any()


@pytest.mark.parametrize("rank", [0, 1])
def test_stream_kernel_classes_from_ranges_are_those_of_the_member_views(rank):
    """prepare.chunk_classes (the lowering-ahead thread's stream variants) from ranged
    chunk segments equals the packer's classes of the views the executor would take, one
    per tensor (the way it was computed before ranges)."""
    import nereus.ir as ir
    from nereus.backends.json_program import program_json
    from nereus.backends.triton import default_packer
    from nereus.passes import compile_transition
    from nereus.runtime import packing, streams
    from nereus.runtime.prepare import chunk_classes, stream_views
    from nereus.runtime.program import rank_program
    from nereus.runtime.wires import TORCH_DTYPES

    module = ir.parse_source("""
cluster c { nodes 1 gpus_per_node 2 gpu { mem 8GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 16GB }
model actor = qwen3_moe { layers 3 hidden 16 heads 4 kv_heads 2 head_dim 8 ffn 32 vocab 32 dtype bf16 experts 8
                          experts_per_token 2 expert_ffn 8 }
workload w { batch 4 prompt 4 response 4 microbatch 1 training: actor }
plan A { actor.training dp 1 ep 2 on 0..1 }
plan B { actor.training dp 1 tp 2 on 0..1 }
""", "classes.nir")
    packer = default_packer()
    for source, target in (("A", "B"), ("B", "A")):
        prog = rank_program(program_json(compile_transition(module, source, target)), rank)
        assert any(p.count > 1 for w in prog.rounds for m in w.sends for p in m.pieces)
        calls = []
        for kind, views, on_host in stream_views(prog, TORCH_DTYPES):
            for segments in streams.chunk_views(views, streams.CHUNK_BYTES):
                if on_host or streams.fused(segments):
                    calls.append((kind, segments, packing.layout([v.numel() * v.element_size() for v in segments])[0]))
        expected = packer.launch_classes(calls)
        assert expected and chunk_classes(prog, packer, TORCH_DTYPES) == expected
