"""The executor with replayed launches (runtime/replay.py) on 2 gloo processes: the Triton
kernels forced on CPU under the interpreter, so the same-GPU copies and the packed
streams' chunks run as replays. TP 2 -> DP 2 after `replay.warm` (what Runtime.prepare
runs): both calls run the warmed replays (none built in a call), byte for byte, the
second onto new shards. The way back (all same-GPU copies), not warmed: its first
execution builds no replay (the per-piece path), its second builds and runs the copies'
replay; byte for byte both times."""

from __future__ import annotations

import pytest
import torch

from nereus.ir.model import Model

from runtime_helpers import naive_program, oracle_units, reference_state, spawn_ok, tensor_list

pytestmark = pytest.mark.multiprocess

MODEL = Model("actor", "llama", layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.inference"


def _wrong(state: dict, units: list, full: dict, rank: int) -> list:
    """The tensors of this rank's shards of `units` in `state` that differ in some byte."""
    from nereus.runtime.state import shard_of

    out = []
    for unit in units:
        for shard in unit["shards"]:
            if shard["gpu"] == rank:
                got, want = state[unit["id"]][shard["tensor"]], shard_of(full[shard["tensor"]], shard["boxes"])
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    out.append(shard["tensor"])
    return out


def _run(rank, world, tensors, before_units, after_units):
    from nereus.runtime import replay
    from nereus.runtime.execution_plan import plan_for
    from nereus.runtime.executor import execute, streams
    from nereus.runtime.program import rank_program
    from nereus.runtime.state import shard_unit

    import torch.distributed as dist

    assert replay.packer_for(torch.device("cpu")) is not None  # the kernels run here
    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    prog = rank_program(naive_program(before_units, after_units, tensors, gpus=world), rank)
    before = {u["id"]: shard_unit(u, rank, full) for u in before_units if rank in u["gpus"]}
    plan = plan_for(prog, streams.CHUNK_BYTES)
    warmed = replay.warm(prog, plan, torch.device("cpu"), streams.DEPTH)
    keys = set(plan.launches)
    wrong = []
    for call in range(2):
        result = execute(prog, before, group=None, control=control, device=torch.device("cpu"))
        wrong += [(call, name) for name in _wrong(result.state, after_units, full, rank)]
    kinds = sorted({key[0] for key in plan.launches if key[0] != "copy boxes"})
    # the way back, not warmed: its first execution builds no replay, its second does
    back = rank_program(naive_program(after_units, before_units, tensors, gpus=world), rank)
    back_plan = plan_for(back, streams.CHUNK_BYTES)
    state = result.state
    built_back = []
    for call in range(2):
        again = execute(back, state, group=None, control=control, device=torch.device("cpu"))
        built_back.append(sorted({key[0] for key in back_plan.launches if key[0] != "copy boxes"}))
        wrong += [("back", call, name) for name in _wrong(again.state, before_units, full, rank)]
    return {"wrong": wrong, "kinds": kinds, "warmed": len(warmed), "built": sorted(map(str, set(plan.launches) - keys)),
            "built_back": built_back}


@pytest.mark.triton
def test_tp_to_dp_with_replayed_copies_and_chunks_is_byte_exact(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("NEREUS_PACK_BACKEND", "triton")
    monkeypatch.setenv("NEREUS_PACK_JIT", "eager")
    tensors = tensor_list(MODEL, training=False)
    before = oracle_units(MODEL, STAGE, 1, 2, 1, [0, 1])
    after = oracle_units(MODEL, STAGE, 2, 1, 1, [0, 1])
    for rank, out in enumerate(spawn_ok(_run, 2, tensors, before, after)):
        assert out["wrong"] == [], rank
        assert out["kinds"] == ["copy", "recv", "send"], rank
        assert out["warmed"] > 0 and out["built"] == [], (rank, out)  # replay.warm built what the calls ran
        assert out["built_back"] == [[], ["copy"]], (rank, out)  # dp -> tp: every rank holds its new shards already
