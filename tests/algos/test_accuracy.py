"""Held-out accuracy, its standard error and pass@k, against values worked by hand."""

import math

import pytest

from rlhf_core.algos.accuracy import mean_pass_at_k, pass_at_k, proportion


def test_proportion_and_its_binomial_standard_error():
    # 3 of 4 correct: p = 0.75, se = sqrt(0.75 * 0.25 / 4) = sqrt(0.046875) = 0.216506...
    p, se = proportion([True, True, False, True])
    assert p == 0.75
    assert se == pytest.approx(0.2165063509, abs=1e-9)
    # all correct: p = 1, se = 0; no rows: (0, 0)
    assert proportion([True] * 5) == (1.0, 0.0)
    assert proportion([]) == (0.0, 0.0)


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n=k: pass@k is 1 when any answer is correct, else 0
    assert pass_at_k(3, 1, 3) == 1.0 and pass_at_k(3, 0, 3) == 0.0
    # k=1: the correct fraction c/n = 1/4
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_mean_pass_at_k_and_its_standard_error():
    # prompts: [T, F] -> pass@2 = 1; [F, F] -> 0; [T, T] -> 1. mean = 2/3;
    # sample variance = ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = (1/9 + 4/9 + 1/9) / 2 = 1/3; se = sqrt(1/3 / 3) = 1/3
    mean, se = mean_pass_at_k([[True, False], [False, False], [True, True]], 2)
    assert mean == pytest.approx(2 / 3)
    assert se == pytest.approx(1 / 3)
    assert mean_pass_at_k([], 2) == (0.0, 0.0)
    assert mean_pass_at_k([[True, False]], 1) == (0.5, 0.0)
    assert math.isclose(mean_pass_at_k([[True], [False]], 1)[1], 0.5)  # values 1, 0: var 0.5, se sqrt(0.5/2)
