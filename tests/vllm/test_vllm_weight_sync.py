"""The compiled weight sync (training layout → generation / engine layout) on gloo, checked
against slicing the full tensors directly, and against the gather-then-slice baseline."""

from __future__ import annotations

import pytest
import torch

from nereus.backends.json_program import placement_units
from nereus.models import OPTIMIZER_STATES, optimizer_name, tensor_table
from nereus.runtime.state import shard_unit, unit_on_gpu

from vllm_sync_cases import launch, sync_test_module

# (training (dp, tp, pp, gpus), generation (dp, tp, pp, gpus), engine_input)
CASES = {
    "tp4-to-dp4": ((1, 4, 1, (0, 1, 2, 3)), (4, 1, 1, (0, 1, 2, 3)), False),
    "same-layout": ((2, 2, 1, (0, 1, 2, 3)), (2, 2, 1, (0, 1, 2, 3)), False),
    "tp2pp2-to-tp2-engine": ((1, 2, 2, (0, 1, 2, 3)), (2, 2, 1, (3, 2, 1, 0)), True),
    "dp2tp2-to-tp1-reversed": ((2, 2, 1, (0, 1, 2, 3)), (4, 1, 1, (3, 2, 1, 0)), False),
}


def _full(module) -> dict:
    gen = torch.Generator().manual_seed(7)
    model = module.model("actor")
    weights = {f"actor/{s.name}": torch.randn(s.shape, generator=gen) for s in tensor_table(model)}
    # training units hold optimizer state too; the sync must ignore it
    state = {optimizer_name(k, s): torch.full_like(v, 3.0) for k, v in weights.items() for s in OPTIMIZER_STATES}
    return {**weights, **state}


def _local(units, rank, full) -> dict:
    unit = unit_on_gpu(units, rank)
    return shard_unit(unit, rank, full) if unit is not None else {}


def _worker(rank, world, cases):
    from nereus.runtime.vllm_engine import engine_placement
    from nereus.runtime.vllm_sync import WeightSync, gather_then_slice

    out = {}
    for name, (training, generation, engine_input) in cases.items():
        module = sync_test_module(training, generation)
        plan = module.plan("P")
        full = _full(module)
        model = module.model("actor")
        source = _local(placement_units(model, plan.placement("actor.training")), rank, full)
        target_placement = plan.placement("actor.generation")
        if engine_input:
            target_placement = engine_placement(target_placement)
        expected = _local(placement_units(model, target_placement), rank, full)
        assert all("#" not in k for k in expected) and any("#" in k for k in source)
        sync = WeightSync(module, engine_input=engine_input)
        got = sync.run("P", source)
        again = sync.run("P", source)  # cached program, same answer
        base = gather_then_slice(module, "P", source, engine_input=engine_input)
        out[name] = {
            "names_ok": set(got.weights) == set(expected) == set(base.weights) == set(again.weights),
            "equal": all(torch.equal(got.weights[k], expected[k]) and torch.equal(base.weights[k], expected[k])
                         and torch.equal(again.weights[k], expected[k]) for k in expected),
            "sent": got.bytes_sent, "received": got.bytes_received, "base_received": base.bytes_received,
            "base_sent": base.bytes_sent, "kept": got.bytes_kept,
            # the sync ran from this rank's part alone: no rank fetched the whole program
            "own_part_only": sync.part("P")[0].get("rank") == rank and not sync._programs,
        }
    return out


@pytest.fixture(scope="module")
def results():
    return launch(_worker, 4, CASES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_delivers_exact_target_shards(results, case):
    for rank_result in results:
        assert rank_result[case]["names_ok"]
        assert rank_result[case]["equal"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_sync_moves_no_more_than_baseline(results, case):
    nereus = sum(r[case]["received"] for r in results)
    baseline = sum(r[case]["base_received"] for r in results)
    assert sum(r[case]["sent"] for r in results) == nereus
    assert sum(r[case]["base_sent"] for r in results) == baseline
    assert nereus < baseline


@pytest.mark.multiprocess
def test_same_layout_moves_nothing(results):
    assert sum(r["same-layout"]["received"] for r in results) == 0
    assert all(r["same-layout"]["kept"] > 0 for r in results)


@pytest.mark.multiprocess
def test_each_rank_syncs_from_its_own_part_of_the_program(results):
    assert all(r[name]["own_part_only"] for r in results for name in CASES)
