"""The runtime never holds the whole program on a rank (nereus.runtime.distribute): each
rank lowers its own part, the part holds only that rank's ops and the shards it or its
messages touch, transitions stay byte-exact, and a part that differs from the proven one
is refused on its rank (the others say which rank refused; nobody hangs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.backends.rank_json import canonical_json, split_by_rank
from nereus.ir.diagnostics import ProgramError
from nereus.passes import compile_transition
from nereus.runtime import Runtime

from runtime_helpers import spawn

pytestmark = pytest.mark.multiprocess

WORLD = 3
# A on GPUs 0, 1 and B on 1, 2 (tp 2 both), and the critic trained on 0..2 in both plans
# with a different split: every rank has ops the others never see
SOURCE = """
cluster cpu {
  nodes 1
  gpus_per_node 3
  gpu { mem 1GB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 16GB
}
model actor = llama { layers 3 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
model critic = actor { head value }
workload w {
  batch 2  prompt 8  response 8  microbatch 1
  generation: actor
  training: critic
}
plan A { actor.generation dp 1 tp 2 on 0, 1   critic.training dp 1 pp 3 on 0..2 }
plan B { actor.generation dp 1 tp 2 on 1, 2   critic.training dp 3 on 0..2 }
"""
STAGES = ("actor.generation", "critic.training")


def _involves(op: dict, rank: int) -> bool:
    return rank in (op["src"], op["dst"]) if op["op"] == "send" else op["gpu"] == rank


def _fulls(rt) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {ms: {name: torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point
                 else torch.tensor(7, dtype=dtype)
                 for name, (shape, dtype) in rt.tensor_specs(ms).items()} for ms in STAGES}


def _exact(rt, fulls) -> bool:
    """This rank's state equals its shards of the full state dicts in the current plan
    (each rank checks its own: no gather, which is slow over three gloo ranks)."""
    for ms in STAGES:
        want, got = rt.shard_state_dict(ms, fulls[ms]), rt.state(ms)
        if set(want) != set(got) or not all(torch.equal(got[n], t) for n, t in want.items()):
            return False
    return True


def _to_b(rt, refused=ProgramError) -> tuple:
    """Register seeded state and try A -> B: (full state dicts, the report), or (fulls,
    {"error": message, "unchanged": whether the old state stands}) when it is refused."""
    fulls = _fulls(rt)
    for ms in STAGES:
        rt.register(ms, rt.shard_state_dict(ms, fulls[ms]))
    held = {ms: {n: t.clone() for n, t in rt.state(ms).items()} for ms in STAGES}
    try:
        return fulls, rt.transition("B")
    except refused as error:
        unchanged = rt.plan == "A" and all(torch.equal(held[ms][n], t) for ms in STAGES
                                           for n, t in rt.state(ms).items())
        return fulls, {"error": error.message, "unchanged": unchanged}


def _parts(rank, world, corrupt_rank):
    import nereus.runtime.distribute as distribute

    if rank == corrupt_rank:  # this rank's part loses one segment: a part the proof never saw
        lower = distribute._lower_own_part

        def corrupted(*args):
            compiled, part = lower(*args)
            for rnd in part["rounds"]:
                for op in rnd["ops"]:
                    if len(op.get("segments", ())) > 1:
                        op["segments"].pop()
                        return compiled, part
            raise AssertionError("no op with two segments to corrupt")

        distribute._lower_own_part = corrupted
    module = ir.parse_source(SOURCE, "parts.nir")
    rt = Runtime(module, "A", rank=rank, world_size=world)
    fulls, report = _to_b(rt)
    if isinstance(report, dict):
        return report
    part = json.loads(rt._programs[("A", "B")][0])  # the runtime keeps the part's canonical text
    exact_b = _exact(rt, fulls)
    back = rt.transition("A")
    exact_a = _exact(rt, fulls)
    return {"part": part, "program_bytes": report.program_bytes, "proof_s": report.verify_program_s,
            "back_bytes": back.program_bytes, "exact": exact_b and exact_a}


def test_each_rank_holds_only_its_part_and_transitions_stay_byte_exact():
    results = spawn(_parts, WORLD, None)
    module = ir.parse_source(SOURCE, "parts.nir")
    whole = program_json(compile_transition(module, "A", "B"))
    expected = split_by_rank(whole)
    whole_ops = sum(len(r["ops"]) for r in whole["rounds"])
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        out = res[1]
        part = out["part"]
        assert out["exact"]
        assert part["rank"] == rank and part == expected[rank]
        ops = [op for rnd in part["rounds"] for op in rnd["ops"]]
        assert ops and all(_involves(op, rank) for op in ops), f"rank {rank} holds another rank's op"
        others = [op for rnd in whole["rounds"] for op in rnd["ops"] if not _involves(op, rank)]
        assert others and len(ops) + len(others) == whole_ops  # the test means something: others exist
        shard_gpus = {s["gpu"] for side in part["units"].values() for u in side for s in u["shards"]}
        assert shard_gpus <= {rank, *part["peers"]}
        assert out["program_bytes"] == len(canonical_json(part)) < len(canonical_json(whole))
        assert out["proof_s"] > 0 and out["back_bytes"] > 0


def test_a_corrupted_rank_part_is_refused_on_that_rank_and_no_rank_hangs():
    results = spawn(_parts, WORLD, 1)
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        out = res[1]
        assert out["unchanged"], out
        if rank == 1:
            assert "rank 1 refuses its part of the program A -> B" in out["error"], out
            assert "verified program" in out["error"]
        else:
            assert out["error"].startswith("rank 1 refused its part of the program A -> B"), out


def test_every_process_lowers_the_same_part_whatever_its_hash_seed(tmp_path):
    """The design rests on deterministic compiles: two processes with different string
    hash seeds lower byte-identical parts."""
    path = tmp_path / "parts.nir"
    path.write_text(SOURCE)
    texts = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-m", "nereus.cli", str(path), "--transition", "A:B", "--emit", "json",
                               "--rank", "1"], env=env, capture_output=True, text=True, check=True)
        texts.append(done.stdout)
    assert texts[0] and texts[0] == texts[1]


def test_a_rank_beyond_the_clusters_gpus_gets_an_empty_part_with_every_round():
    """A process group larger than the plans' cluster: the extra rank's part has no op and
    no unit, and the runtime reader gives it one empty round per round of the program."""
    from nereus.backends.proof import rank_part as _part
    from nereus.runtime.program import rank_program

    compiled = compile_transition(ir.parse_source(SOURCE, "parts.nir"), "A", "B")
    part = _part(compiled, WORLD)
    assert part["rank"] == WORLD and part["units"] == {"before": [], "after": []}
    assert len(part["rounds"]) == compiled.program.num_rounds and not any(r["ops"] for r in part["rounds"])
    work = rank_program(part, WORLD)
    assert not work.before and len(work.rounds) == compiled.program.num_rounds
    assert not any(w.sends or w.recvs or w.copies or w.allocs for w in work.rounds)
