"""Two gloo processes: GRPO on the `pattern` task learns within N = 30 steps.

The rule reward of a random policy is about 1/16 per token (10 digits among 16 tokens,
one of which is right); the test asserts that the mean reward of steps 21-30 exceeds that
of steps 1-10 by at least 0.1 (measured: 0.080 -> 0.236 with seed 3), with a plan
change to TP 2 training after step 10 on the way."""

import pytest

from nereus.rl.algorithms import RlConfig
from nereus.rl.trainer import RlTrainer, TrainSpec

from rl_harness import run_world
from rl_plans import tiny_module, uniform

pytestmark = pytest.mark.multiprocess

N = 30


def _train():
    import nereus.runtime as nr

    s1 = {**uniform(2, 1, (0, 1)), "actor.generation": (1, 2, (0, 1))}
    s2 = {**s1, "actor.training": (1, 2, (0, 1)), "actor.generation": (2, 1, (0, 1))}
    module = tiny_module({"S1": s1, "S2": s2}, gpus=2, batch=32, prompt=5, response=4, algo="grpo")
    spec = TrainSpec("S1", N, ((10, "S2"),), seed=3, rl=RlConfig(algo="grpo", lr=3e-3, group=4))
    result = RlTrainer(module, nr.Runtime(module, "S1"), spec).run()
    return [s["reward"] for s in result["steps"]], result["transitions"]


def test_grpo_reward_rises_over_30_steps():
    rewards, transitions = run_world(2, _train)
    assert [t["to"] for t in transitions] == ["S2"]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.1, (first, last, rewards)
