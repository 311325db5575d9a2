"""Runtime.prepare(target) and the report's timing, on 4 gloo ranks: prepare compiles and
lowers the program once (the transition after it compiles nothing and says it was
prepared), opens a link to every peer of the rank's program, leaves the registered state
alone, and the transition still ends with the exact new state; a report's `seconds` end
when the rank is ready to commit, so they cover every round, and `wall_s` adds the
compile of a cold call."""

from __future__ import annotations

import time

import pytest
import torch

import nereus.ir as ir
from nereus.runtime import Runtime
from nereus.runtime.prepare import peers

from runtime_helpers import spawn, spawn_ok
from test_runtime import STAGES, _check, _reference, _source

pytestmark = pytest.mark.multiprocess


def _run(rank, world):
    module = ir.parse_source(_source(seed=5), "prepare.nir")
    rt = Runtime(module, "S0", rank=rank, world_size=world, direct_min_bytes=4096)
    refs = {ms: _reference(rt, ms, seed=i) for i, ms in enumerate(STAGES)}
    for ms, full in refs.items():
        rt.register(ms, rt.shard_state_dict(ms, full))
    identities = {ms: {k: id(v) for k, v in rt.state(ms).items()} for ms in STAGES}
    prepared = rt.prepare("S1")
    out = {"prepared": prepared, "plan_after_prepare": rt.plan, "bad_after_prepare": _check(rt, refs),
           "same_objects": all(id(v) == identities[ms][k] for ms in STAGES for k, v in rt.state(ms).items())}
    key = next(iter(rt._lowered))
    out["peers"] = peers(rt._lowered[key])
    warm = rt.transition("S1")
    out.update(warm_compile_s=warm.compile_s, warm_prepared=warm.prepared, bad=_check(rt, refs))
    # unprepared and uncompiled: compile_s > 0 and wall_s covers it; a slow round shows in seconds
    cold = rt.transition("S2", round_hook=lambda index: time.sleep(0.05))
    out.update(cold_compile_s=cold.compile_s, cold_prepared=cold.prepared, cold_seconds=cold.seconds,
               cold_wall_s=cold.wall_s, cold_rounds=len(cold.rounds), bad_cold=_check(rt, refs))
    return out


@pytest.fixture(scope="module")
def per_rank():
    return spawn_ok(_run, 4)


def test_prepare_leaves_the_state_alone(per_rank):
    for result in per_rank:
        assert result["plan_after_prepare"] == "S0"
        assert result["bad_after_prepare"] == [] and result["same_objects"]
        assert result["prepared"]["compile_s"] >= 0 and result["prepared"]["kernels"] == 0  # no Triton on CPU


def test_prepare_opens_a_link_to_every_peer(per_rank):
    for rank, result in enumerate(per_rank):
        assert result["prepared"]["peers"] == len(result["peers"])
        for peer in result["peers"]:
            assert rank in per_rank[peer]["peers"]
    assert any(result["peers"] for result in per_rank)


def test_a_prepared_transition_compiles_nothing_and_is_exact(per_rank):
    for result in per_rank:
        assert result["warm_prepared"] and result["warm_compile_s"] == 0.0
        assert result["bad"] == []


def test_seconds_end_at_the_commit_and_wall_adds_the_compile(per_rank):
    for result in per_rank:
        assert not result["cold_prepared"] and result["cold_compile_s"] > 0
        assert result["cold_seconds"] >= 0.05 * result["cold_rounds"]
        assert result["cold_wall_s"] >= result["cold_seconds"] + result["cold_compile_s"]
        assert result["bad_cold"] == []


def _room_run(rank, world):
    import torch
    import torch.distributed as dist

    from nereus.runtime.prepare import all_have_room

    cpu = torch.device("cpu")
    return {"one_short": all_have_room(100, 50 if rank == 2 else 1000, None, cpu),  # rank 2 lacks room
            "all_fit": all_have_room(100, 1000, None, cpu),
            "unknown": all_have_room(100, None, dist.new_group(backend="gloo"), cpu)}


@pytest.mark.multiprocess
def test_the_large_link_warm_up_is_skipped_everywhere_when_one_rank_lacks_room():
    # prepare's chunk-sized exchange: a rank that skipped it while a peer posted it would
    # leave the peer waiting, so every rank must get the same answer
    results = spawn(_room_run, 4)
    for rank, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {rank}: {res}"
        assert res[1] == {"one_short": False, "all_fit": True, "unknown": True}, (rank, res[1])


def test_warm_compiler_compiles_on_the_callers_gpu(monkeypatch):
    """The packer's compile thread starts on GPU 0 whatever the caller's current device is:
    a runtime given device "cuda" (no index) on rank 1 must have its variants compiled on
    GPU 1 (else they are marked compiled while GPU 1 has none, and GPU 0 gets a context)."""
    from types import SimpleNamespace

    from nereus.backends.triton.packer import Packer
    from nereus.runtime import prepare

    asked = []
    packer = Packer(backend="triton")  # its compile thread is not started: the device it would get is kept
    monkeypatch.setattr(packer, "backend_for", lambda device: "triton")
    monkeypatch.setattr(packer, "compile_pending", lambda: asked.append(packer._missing_device))
    monkeypatch.setattr(prepare, "_pack_kernels", lambda device: SimpleNamespace(default_packer=lambda: packer))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert prepare.warm_compiler(torch.device("cuda"))
    assert prepare.warm_compiler(torch.device("cuda", 3))
    assert asked == [torch.device("cuda", 1), torch.device("cuda", 3)]
