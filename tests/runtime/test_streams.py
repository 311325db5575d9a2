"""Per-peer packed streams (nereus.runtime.streams): how a stream is cut into chunks, and
the executor moving pieces through small chunks and a short ring on 2 gloo processes,
byte-exact in both directions at once, with a fault mid-stream rolled back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime.control import TransitionAborted
from nereus.runtime.executor import execute
from nereus.runtime.packing import layout
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit
from nereus.runtime.streams import PeerStream, chunk_views, streamed, unpack_chunk

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.training"
CHUNK, DEPTH = 512, 2  # bytes per chunk, ring slots: far more chunks than slots


def _bytes(views) -> bytes:
    return b"".join(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for v in views)


def test_chunks_cover_the_views_in_order_and_split_rows_at_the_limit():
    base = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    views = [base[:, 1:4], base[3:9], torch.arange(7, dtype=torch.int64), base[0, 0]]  # strided, rows, 1-D, 0-d
    chunks = chunk_views(views, 200)
    assert _bytes([s for c in chunks for s in c]) == _bytes(views)
    for c in chunks:
        _, total = layout([s.numel() * s.element_size() for s in c])
        assert total <= 200 or len(c) == 1  # a chunk overflows only with one row too large for it
    assert len(chunks) > 3
    # cut from shapes alone: meta views give the same segment shapes
    meta = chunk_views([v.to("meta") for v in views], 200)
    assert [[tuple(s.shape) for s in c] for c in meta] == [[tuple(s.shape) for s in c] for c in chunks]


def test_one_oversized_row_travels_alone_and_ring_slots_stay_within_the_stream():
    rows = torch.zeros(4, 100, dtype=torch.float32)  # 400-byte rows, 256-byte chunks
    chunks = chunk_views([rows], 256)
    assert [len(c) for c in chunks] == [1, 1, 1, 1] and all(c[0].shape == (1, 100) for c in chunks)
    stream = PeerStream(1, [rows, torch.zeros(10)], torch.device("cpu"), chunk_bytes=256, depth=2)
    assert len(stream.chunks) == 5 and len(stream.slots) == 2
    assert stream.buffer_bytes <= sum(c.nbytes for c in stream.chunks)


def test_a_large_view_travels_in_chunks_of_its_own_in_place_where_contiguous():
    base = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)  # 32-byte rows
    small, rows, cols = torch.arange(5, dtype=torch.float32), base[8:40], base[:, :4]  # 1024 B contiguous, strided
    views = [small, rows, small.clone(), cols, small.clone()]
    chunks = chunk_views(views, 512, alone_bytes=1000)
    assert _bytes([s for c in chunks for s in c]) == _bytes(views)
    # the small views never share a chunk with a large one; a large one is cut at the chunk size
    assert [[tuple(v.shape) for v in c] for c in chunks] == [[(5,)], [(16, 8)], [(16, 8)], [(5,)], [(32, 4)],
                                                            [(32, 4)], [(5,)]]
    assert [len(c) for c in chunk_views(views, 512, alone_bytes=0)] != [len(c) for c in chunks]
    stream = PeerStream(1, views, torch.device("cpu"), chunk_bytes=512, depth=8, alone_bytes=1000)
    wired = [c.wire is not None for c in stream.chunks]
    assert wired == [True, True, True, True, False, False, True]  # single contiguous segments go in place
    # in place: the wire is the tensor's own memory, and no slot is sized for it
    assert stream.chunks[1].wire.data_ptr() == rows.data_ptr() and stream.buffer(1).numel() == 16 * 8 * 4
    assert stream.buffer_bytes == 2 * 32 * 4 * 4
    # the op size is the segment's bytes on both sides, whichever side packs
    assert [c.nbytes for c in stream.chunks] == [20, 512, 512, 20, 512, 512, 20]


def test_pieces_go_in_place_one_way_and_into_the_stream_both_ways():
    from types import SimpleNamespace as Piece

    big, small, strided = Piece(direct=True, nbytes=64 << 20), Piece(direct=True, nbytes=4096), \
        Piece(direct=False, nbytes=64 << 20)
    assert [streamed(p, False, 128 << 20) for p in (big, small, strided)] == [False, False, True]
    assert [streamed(p, True, 128 << 20) for p in (big, small, strided)] == [True, True, True]
    assert not streamed(Piece(direct=True, nbytes=256 << 20), True, 128 << 20)  # a chunk or more: its own op


def _cases():
    u = lambda dp, tp, pp: oracle_units(MODEL, STAGE, dp, tp, pp, [0, 1])  # noqa: E731
    return [("tp2-dp2", u(1, 2, 1), u(2, 1, 1), None),  # both directions at once, strided pieces
            ("pp2-tp2", u(1, 1, 2), u(1, 2, 1), None),
            ("tp2-dp2 fault", u(1, 2, 1), u(2, 1, 1), (1, 0, "post")),
            ("tp2-dp2 alone", u(1, 2, 1), u(2, 1, 1), None)]  # large pieces in chunks of their own


def _run(rank, world, tensors):
    import nereus.runtime.streams as streams_module

    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    out = {}
    for name, before_units, after_units, fault in _cases():
        program = naive_program(before_units, after_units, tensors, gpus=world)
        prog = rank_program(program, rank, direct_min_bytes=1 << 30)  # every piece in the stream
        before = {u["id"]: shard_unit(u, rank, full) for u in before_units if rank in u["gpus"]}
        snapshot = {u: {k: v.clone() for k, v in t.items()} for u, t in before.items()}
        alone = 256 if name.endswith("alone") else 0
        chunks = sum(len(chunk_views([before[p.src_unit][name][p.src_slices] for p in m.pieces for name in p.tensors],
                                     CHUNK, alone))
                     for w in prog.rounds for m in w.sends)
        landed = []  # per chunk received: whether it landed in place (no unpack)
        streams_module.unpack_chunk = lambda chunk, buffer: (landed.append(chunk.wire is not None),
                                                             unpack_chunk(chunk, buffer))[1]
        # "alone": every piece of 256 bytes or more travels in chunks of its own, in place
        # where its view is contiguous (a dim-1 slice of a row-parallel weight is not)
        streams_module.ALONE_BYTES = 256 if name.endswith("alone") else 0
        streams_module.IN_PLACE = name.endswith("alone")
        try:
            result = execute(prog, before, group=None, control=control, device=torch.device("cpu"), verify=True,
                             fault=fault, chunk_bytes=CHUNK, depth=DEPTH)
        except TransitionAborted as error:
            intact = all(torch.equal(before[u][k], snapshot[u][k]) for u in before for k in before[u])
            out[name] = {"aborted": str(error), "intact": intact}
            continue
        wrong = [s["tensor"] for unit in after_units for s in unit["shards"] if s["gpu"] == rank
                 and not torch.equal(result.state[unit["id"]][s["tensor"]], shard_of(full[s["tensor"]], s["boxes"]))]
        out[name] = {"wrong": wrong, "verified": result.verified, "chunks": chunks, "wired": (sum(landed), len(landed)), "sent": result.sent_bytes,
                     "received": result.received_bytes, "buffers": result.buffer_peak_bytes}
    return out


@pytest.fixture(scope="module")
def per_rank():
    results = spawn(_run, 2, tensor_list(MODEL, training=True))
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


@pytest.mark.multiprocess
def test_small_chunks_through_a_short_ring_are_byte_exact_in_both_directions(per_rank):
    for rank, cases in enumerate(per_rank):
        for name in ("tp2-dp2", "pp2-tp2"):
            case = cases[name]
            assert case["wrong"] == [] and case["verified"] is True, (rank, name, case)
            assert case["chunks"] > 4 * DEPTH, (rank, name, case)  # the ring's slots were reused
            assert case["sent"] > 0 and case["received"] > 0  # both directions at once
            assert case["buffers"] <= 2 * DEPTH * CHUNK + 64, (rank, name, case)  # the ring bounds the memory


@pytest.mark.multiprocess
def test_large_pieces_in_place_are_byte_exact_with_smaller_buffers(per_rank):
    for rank, cases in enumerate(per_rank):
        case, packed = cases["tp2-dp2 alone"], cases["tp2-dp2"]
        assert case["wrong"] == [] and case["verified"] is True, (rank, case)
        wired, received = case["wired"]
        assert 0 < wired < received, (rank, case)  # received in place, and through slots (dim-1 slices)
        assert packed["wired"][0] == 0, (rank, packed)
        assert case["sent"] == packed["sent"] and case["buffers"] <= packed["buffers"], (rank, case, packed)


@pytest.mark.multiprocess
def test_a_fault_after_posting_aborts_both_ranks_with_the_old_state_intact(per_rank):
    for rank, cases in enumerate(per_rank):
        case = cases["tp2-dp2 fault"]
        assert "injected fault (post)" in case["aborted"] and "rank 1, round 0" in case["aborted"], (rank, case)
        assert case["intact"], rank


def _runtime_run(rank, world):
    """A Runtime on gloo with 3 data groups (created and connected in the constructor)
    and small chunks, through two random plan changes and back."""
    import nereus.ir as ir
    import nereus.runtime.streams as streams_module
    from nereus.runtime import Runtime
    from test_runtime import STAGES, _check, _reference, _source

    streams_module.CHUNK_BYTES, streams_module.DEPTH = 4096, 2
    module = ir.parse_source(_source(seed=11), "streams.nir")
    rt = Runtime(module, "S0", rank=rank, world_size=world, p2p_groups=3, verify=True)
    refs = {ms: _reference(rt, ms, seed=i) for i, ms in enumerate(STAGES)}
    for ms, full in refs.items():
        rt.register(ms, rt.shard_state_dict(ms, full))
    out = {"groups": len(rt._data)}
    for target in ("S1", "S2", "S0"):
        report = rt.transition(target)
        out[target] = {"bad": _check(rt, refs), "verified": report.verified, "received": report.bytes_received}
    return out


@pytest.mark.multiprocess
def test_a_runtime_over_three_data_groups_moves_small_chunks_byte_exact():
    results = spawn(_runtime_run, 4)
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        out = res[1]
        assert out["groups"] == 3
        for target in ("S1", "S2", "S0"):
            assert out[target]["bad"] == [] and out[target]["verified"] is True, (rank, target, out[target])
    assert sum(res[1]["S1"]["received"] for res in results) > 0
