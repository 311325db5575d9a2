"""The executor's measurement switches (rounds.COPIES_AFTER: same-GPU copies after the
exchange; streams.BOTH_DIRECT_MIN: contiguous pieces travel in place both ways from a size)
move the same bytes as the default, on 2 gloo processes; and each round reports when it was
posted (host seconds from the transition's start; device seconds only on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime import rounds, streams
from nereus.runtime.executor import execute
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.training"
VARIANTS = {"default": (False, 0), "copies-after": (True, 0), "both-direct": (False, 1)}


def test_both_direct_min_sends_contiguous_pieces_in_place_from_its_size():
    piece = SimpleNamespace(direct=True, nbytes=4096)
    strided = SimpleNamespace(direct=False, nbytes=1 << 30)
    saved = streams.BOTH_DIRECT_MIN
    try:
        streams.BOTH_DIRECT_MIN = 0
        assert streams.streamed(piece, True, 128 << 20)  # below a chunk, both ways: streamed
        streams.BOTH_DIRECT_MIN = 4096
        assert not streams.streamed(piece, True, 128 << 20)
        assert streams.streamed(SimpleNamespace(direct=True, nbytes=4095), True, 128 << 20)
        assert streams.streamed(strided, True, 128 << 20)  # strided pieces always pack
    finally:
        streams.BOTH_DIRECT_MIN = saved


def _run(rank, world, tensors):
    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    u = lambda dp, tp, pp: oracle_units(MODEL, STAGE, dp, tp, pp, [0, 1])  # noqa: E731
    out = {}
    for case, (before_units, after_units) in {"tp2-dp2": (u(1, 2, 1), u(2, 1, 1)),
                                              "pp2-tp2": (u(1, 1, 2), u(1, 2, 1))}.items():
        program = naive_program(before_units, after_units, tensors, gpus=world)
        prog = rank_program(program, rank, direct_min_bytes=256)  # small contiguous pieces are direct
        for name, (after, both_min) in VARIANTS.items():
            rounds.COPIES_AFTER, streams.BOTH_DIRECT_MIN = after, both_min
            before = {x["id"]: shard_unit(x, rank, full) for x in before_units if rank in x["gpus"]}
            result = execute(prog, before, group=None, control=control, device=torch.device("cpu"), verify=True,
                             chunk_bytes=1024, depth=2)
            wrong = [s["tensor"] for unit in after_units for s in unit["shards"] if s["gpu"] == rank and not
                     torch.equal(result.state[unit["id"]][s["tensor"]], shard_of(full[s["tensor"]], s["boxes"]))]
            out[(case, name)] = {"wrong": wrong, "verified": result.verified, "copied": result.copied_bytes,
                                 "posted": [r.posted_at_s for r in result.rounds],
                                 "device": [r.device_s for r in result.rounds]}
    rounds.COPIES_AFTER, streams.BOTH_DIRECT_MIN = False, 0
    return out


@pytest.mark.multiprocess
def test_every_variant_is_byte_exact_and_rounds_report_their_post_time():
    results = spawn(_run, 2, tensor_list(MODEL, training=True))
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        for key, case in res[1].items():
            assert case["wrong"] == [] and case["verified"] is True, (rank, key, case)
            assert all(p > 0 for p in case["posted"]) and case["device"] == [None] * len(case["device"]), (rank, key)
        assert res[1][("tp2-dp2", "copies-after")]["copied"] == res[1][("tp2-dp2", "default")]["copied"] > 0
