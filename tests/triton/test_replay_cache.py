"""Replays kept with the execution plan (runtime/replay.py), under the interpreter with the
kernels forced: tables uploaded together start 16-byte aligned (as the variants Packer
compiles expect), the plan's cache drops the least recently used entry (not everything),
and `warm` (Runtime.prepare) builds nothing for copies and streams in host memory."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.backends.triton import replay as kernels_replay
from nereus.passes import compile_transition
from nereus.runtime import packing, replay, streams
from nereus.runtime.execution_plan import plan_for
from nereus.runtime.offload import offloaded_units
from nereus.runtime.program import rank_program


@pytest.fixture
def forced(monkeypatch):
    """The default packer runs the kernels on CPU (the conftest set TRITON_INTERPRET)."""
    monkeypatch.setattr(packing.kernels().default_packer(), "requested", "triton")


def test_tables_uploaded_together_start_16_byte_aligned():
    # one copy piece: a 72-byte segment row, so a table after it would start 8 bytes off
    pairs = [(kernels_replay.Box(0, (3, 5), (5, 1), 0, 4), kernels_replay.Box(1, (3, 5), (8, 1), 0, 4))]
    copies = [kernels_replay.Replay("copy", kernels_replay.copy_pieces(pairs, (0, 0))) for _ in range(3)]
    kernels_replay.to_device(copies, torch.device("cpu"))
    tables = [t for r in copies for x in r.launches for t in (x.segments, x.tiles)]
    assert len(tables) >= 6 and [t.data_ptr() % 16 for t in tables] == [0] * len(tables)
    assert len({t.untyped_storage().data_ptr() for t in tables}) == 1  # one upload


def test_the_plan_cache_drops_the_least_recently_used_entry(monkeypatch):
    monkeypatch.setattr(replay, "MAX_PER_PLAN", 3)
    plan = SimpleNamespace(launches=OrderedDict(), launches_used={}, executions=[1])
    for key in "abc":
        replay._cached(plan, (key,), lambda key=key: key)
    assert replay._cached(plan, ("a",), lambda: "rebuilt") == "a"  # a hit: now the most recent
    replay._cached(plan, ("d",), lambda: "d")
    assert list(plan.launches) == [("c",), ("a",), ("d",)]  # b went, alone
    assert replay._cached(plan, ("b",), lambda: "b", building=False) is None


SOURCE = """
cluster cpu {
  nodes 1  gpus_per_node 2
  gpu { mem 64MB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s  inter 1GB/s  host_mem 1GB
}
model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 128 }
workload w {
  batch 4  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor
}
plan A {
  actor.generation dp 2 tp 1 on 0, 1
  actor.training   dp 1 tp 2 on 0, 1
}
plan B {  # actor.generation into host memory in a new layout; training on the GPUs, moved
  actor.generation dp 1 tp 2 on 1, 0  offload
  actor.training   dp 2 tp 1 on 0, 1
}
"""


def _host_keys(plan, prog, host) -> list:
    """The plan's copy and stream replays with a piece in host memory."""
    out = []
    for key in plan.launches:
        if key[0] not in ("copy", "send", "recv"):
            continue
        round_plan, work = plan.rounds[key[1]], prog.rounds[key[1]]
        if key[0] == "copy":
            pieces = work.copies
        else:
            streams_of = round_plan.send_streams if key[0] == "send" else round_plan.recv_streams
            pieces = next(s for s in streams_of if s.peer == key[2]).pieces
        if any(("before", p.src_unit) in host or ("after", p.dst_unit) in host for p in pieces):
            out.append(key[:3])
    return out


def test_warm_builds_nothing_for_pieces_in_host_memory(forced):
    program = program_json(compile_transition(ir.parse_source(SOURCE, "offload.nir"), "A", "B"))
    host = offloaded_units(program)
    prog = rank_program(program, 0)
    plan = plan_for(prog, streams.CHUNK_BYTES)
    assert replay.warm(prog, plan, torch.device("cpu"), streams.DEPTH, host)
    assert any(key[0] in ("copy", "send", "recv") for key in plan.launches)  # the training stage's
    assert _host_keys(plan, prog, host) == []
    # not told what is offloaded, warm builds replays that can never run (the case is real)
    blind = rank_program(program, 0)
    blind_plan = plan_for(blind, streams.CHUNK_BYTES)
    replay.warm(blind, blind_plan, torch.device("cpu"), streams.DEPTH)
    assert _host_keys(blind_plan, blind, host)


def test_warm_steps_builds_one_replay_per_item(forced):
    """Each item of warm_steps is one more replay in the plan (a round's copies, or one
    stream's chunks) and its variants; together they are what warm builds and returns."""
    program = program_json(compile_transition(ir.parse_source(SOURCE, "offload.nir"), "B", "A"))
    prog = rank_program(program, 0)
    plan = plan_for(prog, streams.CHUNK_BYTES)

    def replays() -> int:
        return sum(key[0] in ("copy", "send", "recv") for key in plan.launches)

    built, items = [], []
    for variants in replay.warm_steps(prog, plan, torch.device("cpu"), streams.DEPTH):
        built.append(replays())
        items.append(variants)
    assert len(items) >= 2 and built == list(range(1, len(items) + 1)), built
    assert all(items), items
    again = rank_program(program, 0)
    assert frozenset().union(*items) == replay.warm(again, plan_for(again, streams.CHUNK_BYTES),
                                                    torch.device("cpu"), streams.DEPTH)
