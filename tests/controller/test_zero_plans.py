"""The controller, the simulator and the plan search use the compiler's memory model, ZeRO
included: a plan `nereusc check` says fits runs, the search offers zero 1 and 3 to training,
and a policy that runs no step is said to, with why."""

import json
import os
from dataclasses import replace

import pytest
from click.testing import CliRunner

import nereus.ir as ir
import nereus.controller.search as search
from nereus.controller.cost_model import CostModel
from nereus.controller.memory import plan_memory
from nereus.controller.simulator import load_trace, simulate
from nereus.passes.feasibility import check_plan

HERE = os.path.dirname(__file__)
ZERO = os.path.join(HERE, "zero.nir")


@pytest.fixture(scope="module")
def zero():
    return ir.parse_file(ZERO)


def _trace(tmp_path, plan: str, steps: int = 4) -> str:
    path = tmp_path / f"{plan}.json"
    path.write_text(json.dumps({"nir": ZERO, "plan": plan, "seed": 1,
                                "steps": [{"response": 1024, "gpus": 8}] * steps}))
    return str(path)


def test_a_plan_that_fits_by_zero_fits_the_controller_too(zero):
    for name, fits in (("S1", True), ("S0", False)):
        assert check_plan(zero, name).feasible is fits
        memory = plan_memory(zero, zero.workload, zero.plan(name), allow_waves=False)
        assert memory.feasible is fits
        assert memory.worst_bytes == check_plan(zero, name).worst.bytes


def test_the_fixed_policy_runs_a_plan_that_fits_by_zero(tmp_path):
    result = simulate(load_trace(_trace(tmp_path, "S1")), policies=("fixed", "nereus"),
                      transition_method="estimate")
    fixed = result["policies"]["fixed"]
    assert fixed["failed_at"] is None and fixed["steps_run"] == 4 and fixed["transitions"] == 0


def test_the_search_offers_zero_to_training_and_takes_it_where_it_is_faster(zero, monkeypatch):
    offered = search.candidate_choices(zero, zero.workload, zero.plan("S1").placements[3].model_stage, 8)
    assert {c.zero for c in offered if c.dp > 1} == {0, 1, 3}
    assert {c.zero for c in offered if c.dp == 1} == {0}
    found = search.search_plan(zero, zero.workload, CostModel(zero), 4)
    assert any(p.zero for p in found.plan.placements)
    module = replace(zero, plans=(replace(found.plan, name="found"),))
    assert check_plan(module, "found").feasible  # what the search returns, nereusc accepts
    monkeypatch.setattr(search, "ZERO_STAGES", (0,))  # the space without zero: slower
    assert search.search_plan(zero, zero.workload, CostModel(zero), 4).predicted_s > found.predicted_s


def test_a_policy_that_ran_no_step_is_said_to_with_why(tmp_path):
    from nereus.cli import nereus as cli

    result = CliRunner().invoke(cli, ["simulate", _trace(tmp_path, "S0", 3), "--estimate-transitions", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "over the 0 steps" not in result.output
    assert ("fixed failed at step 0: its plan does not fit (response 1024): GPU 0 needs 41.5 GiB in training "
            "but has 22.4 GiB") in result.output
    assert "no step is common to every policy (fixed ran no step)" in result.output


def test_the_cost_model_prices_zero_as_the_zero_paper_does(zero):
    """ZeRO-1: the data-parallel bytes of an all-reduce (reduce-scatter + all-gather), Adam on
    the replica's 1/dp chunk; ZeRO-3: 1.5x the data-parallel bytes (§7.2)."""
    from nereus.controller.cost_model import TERMS, Layout, stage_terms

    ms = zero.plan("S1").placements[3].model_stage
    dp, optimizer = TERMS.index("dp"), TERMS.index("optimizer")
    plain, one, three = (stage_terms(zero, zero.workload, ms, Layout(8, 1, 1, zero=z)) for z in (0, 1, 3))
    assert one[dp] == pytest.approx(plain[dp]) and three[dp] == pytest.approx(1.5 * plain[dp])
    assert one[optimizer] == pytest.approx(plain[optimizer] / 8) == pytest.approx(three[optimizer])
    assert all(one[i] == plain[i] for i in range(len(TERMS)) if i not in (dp, optimizer))
