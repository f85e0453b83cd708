"""Held-out accuracy with its standard error, and pass@k.

A held-out answer is correct or not (a verifier's score at or above a threshold). The accuracy over n prompts is a
proportion p with the binomial standard error sqrt(p (1 - p) / n). pass@k is the chance that at least one of k
answers to a prompt is correct, estimated from n >= k samples with c correct by the unbiased estimator of Chen et
al. (2021, "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), averaged over prompts;
its standard error is the spread of the per-prompt estimates over the prompts, std / sqrt(prompts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def proportion(correct: Sequence[bool]) -> tuple[float, float]:
    """(p, standard error) of the correct fraction: sqrt(p (1 - p) / n); (0, 0) for no rows."""
    n = len(correct)
    if n == 0:
        return 0.0, 0.0
    p = sum(bool(c) for c in correct) / n
    return p, math.sqrt(p * (1.0 - p) / n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct answers among ``n`` samples (``n >= k``)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct answer
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> tuple[float, float]:
    """(mean pass@k over prompts, its standard error) of each prompt's correct flags; (0, 0) for no prompts."""
    return mean_and_se([pass_at_k(len(flags), sum(bool(f) for f in flags), k) for flags in correct])


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean: sample std / sqrt(n)); the error is 0 for one value, (0, 0) for none."""
    m = len(values)
    if m == 0:
        return 0.0, 0.0
    mean = sum(values) / m
    if m == 1:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(var / m)
