"""Deferred destinations (execution_plan.RoundPlan.deferred): after-shards that only
same-GPU copies and slot-received chunks write are allocated after the round's
agreement, when first written, on 2 gloo ranks: the state is byte-exact, the reported
peak is the one of allocating them up front, and an allocation that fails then aborts
every rank with the old state intact (every op was posted, so no rank waits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime import executor, offload, rounds
from nereus.runtime.control import TransitionAborted
from nereus.runtime.execution_plan import plan_for
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list

pytestmark = pytest.mark.multiprocess

MODEL = Model("actor", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
STAGE = "actor.training"
CHUNK, DEPTH = 512, 2


def _run(rank, world, tensors):
    rounds.DEFER_DESTINATIONS = True  # opt-in (NEREUS_DEFER_DESTINATIONS=1); this process only
    control = dist.new_group(backend="gloo")
    full = reference_state(tensors)
    u = lambda dp, tp: oracle_units(MODEL, STAGE, dp, tp, 1, [0, 1])  # noqa: E731
    before_units, after_units = u(1, 2), u(2, 1)  # tp 2 -> dp 2: half received, half copied
    program = naive_program(before_units, after_units, tensors, gpus=world)
    prog = rank_program(program, rank, direct_min_bytes=1 << 30)
    deferred = plan_for(prog, CHUNK).rounds[0].deferred
    out = {"deferred": len(deferred), "shards": sum(len(s) for s in prog.after.values())}

    log = []
    real_agree, real_new = rounds.agree, offload.new_shard
    rounds.agree = lambda *a, **k: (log.append(("agree",)), real_agree(*a, **k))[1]

    def new_shard(unit, shape, dtype, live, device, host_units):
        log.append(("alloc", unit))
        if out.get("fail") and rank == 1 and ("agree",) in log:  # a deferred one, the data under way
            raise torch.OutOfMemoryError("no room (test)")
        return real_new(unit, shape, dtype, live, device, host_units)

    offload.new_shard = new_shard
    try:
        for fail in (False, True):
            out["fail"] = fail
            log.clear()
            before = {u["id"]: shard_unit(u, rank, full) for u in before_units if rank in u["gpus"]}
            snapshot = {unit: {k: v.clone() for k, v in t.items()} for unit, t in before.items()}
            try:
                result = executor.execute(prog, before, group=None, control=control, device=torch.device("cpu"),
                                          chunk_bytes=CHUNK, depth=DEPTH)
            except TransitionAborted as error:
                out["aborted"] = str(error)
                out["intact"] = all(torch.equal(before[u][k], snapshot[u][k]) for u in before for k in before[u])
                continue
            first_agree = log.index(("agree",))
            out["allocs_after_agree"] = sum(1 for e in log[first_agree:] if e[0] == "alloc")
            out["wrong"] = [s["tensor"] for unit in after_units for s in unit["shards"] if s["gpu"] == rank
                            and not torch.equal(result.state[unit["id"]][s["tensor"]],
                                                shard_of(full[s["tensor"]], s["boxes"]))]
            out["peak"] = result.peak_bytes
            # the same program with nothing deferred (verify takes every view up front)
            again = executor.execute(prog, {u: dict(t) for u, t in before.items()}, group=None, control=control,
                                     device=torch.device("cpu"), chunk_bytes=CHUNK, depth=DEPTH, verify=True)
            out["peak_up_front"] = again.peak_bytes
    finally:
        rounds.agree, offload.new_shard = real_agree, real_new
    return out


def test_deferred_destinations_are_allocated_after_the_agreement_and_failures_abort_every_rank():
    results = spawn(_run, 2, tensor_list(MODEL, training=True))
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    outs = [res[1] for res in results]
    for rank, out in enumerate(outs):
        assert out["deferred"] > 0 and out["deferred"] <= out["shards"], (rank, out)
        assert out["allocs_after_agree"] == out["deferred"], (rank, out)  # every deferred one, none else
        assert out["wrong"] == [], (rank, out)
        assert out["peak"] == out["peak_up_front"], (rank, out)
        assert "rank 1, round 0" in out["aborted"] and "no room (test)" in out["aborted"], (rank, out)
        assert "unpack recv" in out["aborted"] or "copy" in out["aborted"], (rank, out)
        assert out["intact"], rank
