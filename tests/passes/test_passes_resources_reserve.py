"""resources: where a stalled round would lend the transient reserve to an allocation, the
pass also schedules staging that GPU's before-shards to host memory instead, and keeps the
schedule with the lower predicted time (`cost.schedule_seconds`)."""

import pytest

import nereus.passes.resources as resources
from builders import RING_MODELS, cluster, llama, module, place, ring_module, workload
from nereus.backends.json_program import program_json
from nereus.passes import compile_transition
from nereus.passes.cost import schedule_seconds
from nereus.passes.layout import shard_bytes
from nereus.passes.verify import verify_program
from test_passes_resources_tight import tight_module


def widening_module(n: int, slack_layers: float, layers: int = 4, host_mem: int = 10**10):
    """n single-GPU training units on GPUs 0..n-1, each re-laid out at tp 2 over its own GPU
    and the next. A GPU holds one unit plus `slack_layers` layers: a half-unit after-shard
    fits next to the unit only in the transient reserve, and the unit is still being read."""
    models = [llama(name, layers=layers) for name in RING_MODELS[:n]]
    unit = shard_bytes(models[0], place("actor.training", 1, 1, 1, [0]), 0, 0)
    c = cluster(1, n, unit + int(slack_layers * (unit // (layers + 2))), host_mem)
    before = [place(f"{name}.training", 1, 1, 1, [i]) for i, name in enumerate(RING_MODELS[:n])]
    after = [place(f"{name}.training", 1, 2, 1, [i, (i + 1) % n]) for i, name in enumerate(RING_MODELS[:n])]
    return module(c, models, workload({"training": RING_MODELS[:n]}), {"S": before, "T": after})


def _both(m):
    """(dag, lending schedule, staging schedule, bytes it staged instead of lending) of m's S -> T."""
    dag = compile_transition(m, "S", "T", check_fit=False, pipeline="diff,dag").dag
    lending, _ = resources._schedule(dag, range(len(dag.stages)), staging=True)
    staging, reserve_staged = resources._schedule(dag, range(len(dag.stages)), staging=True, stage_for_reserve=True)
    return dag, lending, staging, reserve_staged


def test_staging_instead_of_lending_is_kept_where_it_is_cheaper():
    m = widening_module(2, 3.3)
    dag, lending, staging, reserve_staged = _both(m)
    assert reserve_staged == staging.staged_bytes > lending.staged_bytes  # lending stages 1 unit for a cycle
    before = schedule_seconds(dag, lending)
    compiled = compile_transition(m, "S", "T", check_fit=False)
    sched = compiled.state.schedule
    # a slice a round through the reserve, or 3 rounds (2 under the cpu memory model, which
    # leaves out the staged sources' buffers: 1.1 MiB over a GPU once they count)
    assert len(lending.rounds) == 30 and len(sched.rounds) == 3
    assert compiled.cost.seconds < before / 5
    assert any("instead of lending the transient reserve" in n for n in sched.notes)
    assert compiled.cost.bytes_staged == sched.staged_bytes > 0  # the bytes that change are staged and reported
    report = verify_program(program_json(compiled), against=m)
    assert report.bytes_moved == sum(x.bytes for x in dag.xfers if x.kind != "keep")
    assert report.worst_fraction <= 1.0


def test_lending_is_kept_where_staging_costs_more():
    m = tight_module(0.05, 4, 4)
    dag, lending, staging, reserve_staged = _both(m)
    assert reserve_staged == staging.staged_bytes > 0
    assert schedule_seconds(dag, staging) > schedule_seconds(dag, lending)
    compiled = compile_transition(m, "S", "T", check_fit=False)
    assert compiled.state.schedule == lending
    assert compiled.cost.bytes_staged == 0
    assert verify_program(program_json(compiled), against=m).worst_fraction <= 1.0


def test_the_lending_schedule_stops_once_slower_than_the_staging_one():
    dag, lending, staging, _ = _both(widening_module(2, 3.3))
    cap = schedule_seconds(dag, staging)
    assert resources._schedule(dag, range(len(dag.stages)), staging=True, seconds_cap=cap)[0] is None
    kept, _ = resources._schedule(dag, range(len(dag.stages)), staging=True,
                                  seconds_cap=schedule_seconds(dag, lending))
    assert kept == lending  # a tie is kept


def test_an_infeasible_staging_alternative_falls_back_to_lending(monkeypatch):
    """Host memory that the reserve's staging takes may be missing later for a cycle: the
    alternative then fails and the lending schedule, which may not need it, is kept."""
    from nereus.ir.diagnostics import InfeasibleError

    m = widening_module(2, 3.3)
    dag, lending, _, _ = _both(m)

    def out_of_host(*args, **kwargs):
        raise InfeasibleError("host memory exhausted by the alternative")

    monkeypatch.setattr(resources, "_stage_for_reserve", out_of_host)
    assert compile_transition(m, "S", "T", check_fit=False).state.schedule == lending


@pytest.mark.parametrize("make", [lambda: widening_module(3, 3.2), lambda: tight_module(0.05, 4, 4),
                                  lambda: tight_module(0.3, 2), lambda: ring_module(3)[0]])
def test_schedule_seconds_is_the_cost_pass_estimate(make):
    compiled = compile_transition(make(), "S", "T", check_fit=False)
    assert schedule_seconds(compiled.dag, compiled.state.schedule) == pytest.approx(compiled.cost.seconds, rel=1e-12)
