"""WeightSync.prepare (gloo): it does the first run's one-time work (the compile and this
rank's lowering, the links) without touching a tensor, the run after it is byte-exact and
compiles nothing, and a rank preparing while another runs makes both raise instead of
waiting."""

from __future__ import annotations

import time

import pytest
import torch

from nereus.backends.json_program import placement_units
from nereus.models import OPTIMIZER_STATES, optimizer_name, tensor_table
from nereus.runtime.state import shard_unit, unit_on_gpu

from vllm_sync_cases import launch, sync_test_module

TRAINING, GENERATION = (1, 2, 1, (0, 1)), (2, 1, 1, (1, 0))  # TP 2 -> DP 2 on the GPUs in reverse


def _shards(module, stage: str, rank: int) -> dict:
    gen = torch.Generator().manual_seed(3)
    model = module.model("actor")
    full = {f"actor/{s.name}": torch.randn(s.shape, generator=gen) for s in tensor_table(model)}
    full.update({optimizer_name(k, s): torch.zeros_like(v) for k, v in list(full.items()) for s in OPTIMIZER_STATES})
    unit = unit_on_gpu(placement_units(model, module.plan("P").placement(stage)), rank)
    return shard_unit(unit, rank, full) if unit is not None else {}


def _prepared(rank, world):
    from nereus.runtime.vllm_sync import WeightSync

    module = sync_test_module(TRAINING, GENERATION, gpus=2)
    source = _shards(module, "actor.training", rank)
    before = {k: v.clone() for k, v in source.items()}
    sync = WeightSync(module)
    figures = sync.prepare("P")
    untouched = all(torch.equal(source[k], before[k]) for k in source)
    lowered = "P" in sync._rank_programs
    got = sync.run("P", source)
    expected = _shards(module, "actor.generation", rank)
    return {"figures": sorted(figures), "peers": figures["peers"], "compile_s": figures["compile_s"],
            "run_compile_s": got.compile_s, "untouched": untouched, "lowered": lowered,
            "equal": set(got.weights) == set(expected) and all(torch.equal(got.weights[k], expected[k])
                                                               for k in expected)}


@pytest.mark.multiprocess
def test_prepare_does_the_first_runs_one_time_work_and_the_run_after_is_exact():
    for rank, got in enumerate(launch(_prepared, 2)):
        assert got["figures"] == ["compile_s", "kernels", "peers", "reserved_bytes", "seconds"]
        assert got["peers"] == 1 and got["compile_s"] > 0 and got["run_compile_s"] == got["compile_s"], got
        assert got["untouched"] and got["lowered"] and got["equal"], (rank, got)


def _out_of_step(rank, world):
    from nereus.ir.diagnostics import NereusError
    from nereus.runtime.vllm_sync import WeightSync

    module = sync_test_module(TRAINING, GENERATION, gpus=2)
    source = _shards(module, "actor.training", rank)
    sync = WeightSync(module, timeout_s=20)
    sync.part("P")  # both compiled: the ranks part at the data links
    started = time.perf_counter()
    try:
        sync.prepare("P") if rank == 0 else sync.run("P", source)
        return ("returned", time.perf_counter() - started)
    except (NereusError, RuntimeError) as error:
        return (type(error).__name__, time.perf_counter() - started, str(error).splitlines()[0])


@pytest.mark.multiprocess
def test_a_rank_preparing_while_another_runs_makes_both_raise():
    for rank, out in enumerate(launch(_out_of_step, 2)):
        assert out[0] == "TransitionAborted" and out[1] < 20, (rank, out)
        assert "at prepare('sync.to')" in out[2] and "at a round agreement of sync.from -> sync.to" in out[2], out
