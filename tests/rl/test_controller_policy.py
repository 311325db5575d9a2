"""The controller's choice is restricted to declared plans this loop can run (one process,
no torch.distributed: rank 0 decides alone)."""

from nereus.rl.adaptive import ControllerPolicy
from nereus.rl.topology import runnable

from rl_plans import tiny_module, uniform


def _module():
    wide = {**uniform(2, 2, range(4)), "actor.training": (1, 4, range(4))}  # tp 4 > kv_heads 2
    return tiny_module({"S1": uniform(1, 1, (0,)), "S2": uniform(1, 1, (1,)), "S3": wide}, gpus=4)


def _observed(runnable_plans):
    module = _module()
    policy = ControllerPolicy(module, "S1", total_steps=50, runnable=runnable_plans)
    stage_seconds = {str(ms): 0.5 for ms in module.workload.model_stages()}
    policy.observe(module, "S1", module.workload, stage_seconds, 2.5)
    return module, policy


def test_runnable_excludes_plans_with_missing_ranks_only():
    module = _module()
    assert [runnable(module, p, 4) for p in module.plans] == [True, True, True]  # tp > kv_heads trains
    assert [runnable(module, p, 3) for p in module.plans] == [True, True, False]
    assert [runnable(module, p, 1) for p in module.plans] == [True, False, False]


def test_controller_never_names_a_plan_the_loop_cannot_run():
    module, free = _observed(())
    assert free.controller.best_plan(module.workload, 4).plan.name == "S3"  # fastest, needs 4 ranks
    ok = tuple(p.name for p in module.plans if runnable(module, p, 3))
    module, policy = _observed(ok)
    assert policy.controller.best_plan(module.workload, 4).plan.name in ok
    targets = [policy.decide(step, module.workload, 4) for step in range(2, 6)]
    assert all(t in (None, "S2") for t in targets), targets
    assert len(policy.decisions) == 4 and all("why" in d for d in policy.decisions)


def test_the_decision_before_a_step_counts_that_step_among_the_remaining():
    """The loop numbers its steps 1..N and asks before step s whether to move: the steps a
    move could repay are s..N, N - s + 1 of them (so a move before the last step weighs one
    step, as the simulator counts it), and the records keep the loop's step numbers."""
    module = _module()
    policy = ControllerPolicy(module, "S1", total_steps=4, runnable=())
    for step in (2, 3, 4):
        policy.decide(step, module.workload, 4)
    assert [(d["step"], d["remaining_steps"]) for d in policy.decisions] == [(2, 3), (3, 2), (4, 1)]
