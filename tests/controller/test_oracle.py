"""The DP oracle: equal to brute force over every plan sequence on small cases."""

import itertools
import math

import numpy as np
import pytest

from nereus.controller.oracle import _score, brute_force_oracle, dp_oracle


@pytest.mark.parametrize("seed", range(12))
def test_dp_oracle_equals_brute_force_on_small_cases(seed):
    rng = np.random.default_rng(seed)
    steps, count = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    step_s = rng.uniform(1.0, 10.0, (steps, count))
    step_s[rng.random((steps, count)) < 0.25] = math.inf  # plans that do not fit some steps
    transition_s = rng.uniform(0.0, 8.0, (count, count))
    start = int(rng.integers(0, count))
    dp = dp_oracle(step_s, transition_s, start)
    brute = brute_force_oracle(step_s, transition_s, start)
    assert math.isfinite(dp.total_s) == math.isfinite(brute.total_s)
    if math.isfinite(dp.total_s):
        assert dp.total_s == pytest.approx(brute.total_s, rel=1e-12)
        # the path it returns attains the total
        assert _score(step_s, transition_s, start, dp.path).total_s == pytest.approx(dp.total_s, rel=1e-12)
        assert dp.failed_at is None


def test_dp_oracle_is_at_most_every_sequence():
    rng = np.random.default_rng(5)
    step_s = rng.uniform(1.0, 3.0, (4, 3))
    transition_s = rng.uniform(0.5, 2.0, (3, 3))
    best = dp_oracle(step_s, transition_s, 0).total_s
    for path in itertools.product(range(3), repeat=4):
        assert best <= _score(step_s, transition_s, 0, path).total_s + 1e-12


def test_dp_oracle_pays_a_transition_only_when_it_repays():
    # plan 1 is 1 s/step faster; moving costs 2.5 s: worth it over 4 steps, not over 2
    step_s = np.array([[10.0, 9.0]] * 4)
    transition_s = np.array([[0.0, 2.5], [2.5, 0.0]])
    assert dp_oracle(step_s, transition_s, 0).path == (1, 1, 1, 1)
    assert dp_oracle(step_s[:2], transition_s, 0).path == (0, 0)


def test_dp_oracle_reports_the_first_step_nothing_fits():
    step_s = np.array([[1.0, 2.0], [math.inf, 2.0], [math.inf, math.inf]])
    result = dp_oracle(step_s, np.zeros((2, 2)), 0)
    assert result.failed_at == 2 and not math.isfinite(result.total_s)
