"""The runtime runs only proven programs: a corrupted program (compile step patched)
is refused with the same clear error on every rank and nothing moves; a sound one is
proven once per (from, to), its cost in the report; verify_programs=False skips it."""

from __future__ import annotations

import pytest
import torch

import nereus.ir as ir
from nereus.ir.diagnostics import ProgramError
from nereus.runtime import Runtime

from runtime_helpers import spawn

pytestmark = pytest.mark.multiprocess

WORLD = 2
SOURCE = """
cluster cpu {
  nodes 1
  gpus_per_node 2
  gpu { mem 1GB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 16GB
}
model actor = llama { layers 2 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
workload w {
  batch 2  prompt 8  response 8  microbatch 1
  generation: actor
}
plan A { actor.generation dp 1 tp 2 on 0, 1 }
plan B { actor.generation dp 2 tp 1 on 0, 1 }
"""


def _swap_a_box(program: dict) -> dict:
    """The issue's first corruption: a segment box with both bounds swapped."""
    for rnd in program["rounds"]:
        for op in rnd["ops"]:
            for seg in op.get("segments", ()):
                if len(seg["box"]) == 2:
                    seg["box"] = [[hi, lo] for lo, hi in seg["box"]]
                    return program
    raise AssertionError("no two-dimensional segment to corrupt")


def _run(rank, world, corrupt, verify_programs):
    import nereus.backends.json_program as emitter

    if corrupt:
        compile_program = emitter.program_json
        emitter.program_json = lambda compiled: _swap_a_box(compile_program(compiled))
    return _transitions(rank, world, verify_programs)


def _sound(rank, world):
    return [_transitions(rank, world, True), _transitions(rank, world, False)]


def _transitions(rank, world, verify_programs):
    module = ir.parse_source(SOURCE, "admission.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world, verify_programs=verify_programs)
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(shape, generator=gen).to(dtype)
            for name, (shape, dtype) in rt.tensor_specs("actor.generation").items()}
    rt.register("actor.generation", rt.shard_state_dict("actor.generation", full))
    held = {name: t.clone() for name, t in rt.state("actor.generation").items()}
    try:
        report = rt.transition("B")
    except ProgramError as error:
        unchanged = rt.plan == "A" and all(torch.equal(held[n], t) for n, t in rt.state("actor.generation").items())
        return {"error": error.message, "unchanged": unchanged}
    back = rt.transition("A")
    again = rt.transition("B")  # proven before: cached
    return {"first": report.verify_program_s, "back": back.verify_program_s, "again": again.verify_program_s}


def test_a_corrupted_program_is_refused_on_every_rank():
    results = spawn(_run, WORLD, True, True)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
        out = res[1]
        assert "refuses the program A -> B" in out["error"] and "round 0, op" in out["error"], out
        assert "not inside" in out["error"] and out["unchanged"]


def test_sound_programs_are_proven_once_per_pair_and_the_cost_reported_unless_turned_off():
    results = spawn(_sound, WORLD)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
        verified, unverified = res[1]
        assert verified["first"] > 0 and verified["back"] > 0 and verified["again"] == 0.0, verified
        assert unverified == {"first": None, "back": None, "again": None}
