"""Executor tests on programs built without the compiler (naive reference programs over
the layout oracle), on 4 gloo processes. Every rank checks its new shards byte for byte
against slices of the reference full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime.control import TransitionAborted
from nereus.runtime.executor import execute
from nereus.passes.verify import verify_program
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list

pytestmark = pytest.mark.multiprocess

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.training"
WORLD = 4


def _layouts():
    """(name, before units, after units, rounds) covering Split, Merge, Extend, Destroy."""
    u = lambda dp, tp, pp, gpus: oracle_units(MODEL, STAGE, dp, tp, pp, gpus)  # noqa: E731
    return [
        ("tp2-tp4", u(1, 2, 1, [0, 1]), u(1, 4, 1, [0, 1, 2, 3]), 2),
        ("tp4-tp1", u(1, 4, 1, [0, 1, 2, 3]), u(1, 1, 1, [3]), 1),
        ("pp1-pp2 moved", u(1, 1, 1, [0]), u(1, 1, 2, [2, 1]), 2),
        ("dp1-dp4 (extend)", u(1, 1, 1, [1]), u(4, 1, 1, [0, 1, 2, 3]), 3),
        ("dp2-dp1 (destroy)", u(2, 2, 1, [0, 1, 2, 3]), u(1, 2, 1, [2, 3]), 1),
        ("tp2pp2-tp4 (gqa replicated kv)", u(1, 2, 2, [0, 1, 2, 3]), u(1, 4, 1, [3, 2, 1, 0]), 2),
        ("tp2-tp4 staged", u(1, 2, 1, [0, 1]), u(1, 4, 1, [0, 1, 2, 3]), -2),  # rounds < 0: stage_out first
    ]


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


# (rank, round, phase); "commit" fails at the commit, reported as round len(rounds) (3 here)
FAULTS = [(1, 0, "pack"), (0, 0, "post"), (2, 1, "unpack"), (3, 3, "commit")]


def _run_cases(rank, world, cases, tensors):
    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    out = []
    for name, before_units, after_units, rounds, fault in cases:
        program = naive_program(before_units, after_units, tensors, rounds=abs(rounds), gpus=world,
                                stage_out=rounds < 0)
        prog = rank_program(program, rank)
        before = {u["id"]: shard_unit(u, rank, full) for u in before_units if rank in u["gpus"]}
        snapshot = {u: {k: v.clone() for k, v in t.items()} for u, t in before.items()}
        try:
            result = execute(prog, before, group=None, control=control, device=torch.device("cpu"),
                             verify=True, fault=fault)
        except TransitionAborted as error:
            intact = all(_bytes_equal(before[u][k], snapshot[u][k]) for u in before for k in before[u])
            out.append({"case": name, "aborted": str(error), "intact": intact, "failures": len(error.failures)})
            continue
        mismatched = []
        for unit in after_units:
            for shard in unit["shards"]:
                if shard["gpu"] == rank:
                    got = result.state[unit["id"]][shard["tensor"]]
                    if not _bytes_equal(got, shard_of(full[shard["tensor"]], shard["boxes"])):
                        mismatched.append(shard["tensor"])
        held = sum(len(t) for t in result.state.values())
        expected = sum(1 for unit in after_units for s in unit["shards"] if s["gpu"] == rank)
        out.append({"case": name, "mismatched": mismatched, "held": held, "expected": expected,
                    "peak": result.peak_bytes, "replay": verify_program(program).peak_bytes.get(rank, 0),
                    "verified": result.verified, "sent": result.sent_bytes, "received": result.received_bytes})
    return out


def _ok(results):
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


@pytest.fixture(scope="module")
def per_rank():
    """One launch of 4 gloo processes runs every case (process start-up dominates)."""
    cases = [c + (None,) for c in _layouts()]
    split = [c for c in _layouts() if c[0] == "tp2-tp4"][0]
    cases += [(f"fault {f}",) + split[1:] + (f,) for f in FAULTS]
    results = _ok(spawn(_run_cases, WORLD, cases, tensor_list(MODEL, training=True)))
    return [{case["case"]: case for case in rank} for rank in results]


def test_transitions_move_every_byte_to_its_new_owner(per_rank):
    per_rank = [[c for name, c in rank.items() if not name.startswith("fault")] for rank in per_rank]
    sent = sum(case["sent"] for rank in per_rank for case in rank)
    received = sum(case["received"] for rank in per_rank for case in rank)
    assert sent == received > 0
    for rank, cases in enumerate(per_rank):
        for case in cases:
            assert case["mismatched"] == [], (rank, case)
            assert case["held"] == case["expected"], (rank, case)
            assert case["verified"] is True
            assert case["peak"] <= case["replay"], (rank, case)
    # a rank with no unit after `tp4-tp1` holds nothing
    assert per_rank[0][1]["held"] == 0 and per_rank[3][1]["held"] > 0


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_one_rank_aborts_every_rank_and_keeps_old_state(per_rank, fault):
    for rank, cases in enumerate(per_rank):
        result = cases[f"fault {fault}"]
        assert "aborted" in result, (rank, result)
        assert result["intact"], rank
        assert f"rank {fault[0]}, round {fault[1]}" in result["aborted"]
        assert f"injected fault ({fault[2]})" in result["aborted"]
        if fault[2] in ("pack", "post"):  # the op named is the one that failed
            assert f"round {fault[1]}, {fault[2]}: " in result["aborted"], result["aborted"]
