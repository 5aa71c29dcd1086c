"""Paired statistics for comparing two methods on the same questions.

Two methods answered the same n questions, so their per-question outcomes are
paired: the paired bootstrap resamples questions (not outcomes of each method
separately) and gives a confidence interval of the mean difference; the exact
McNemar test asks whether the discordant questions (one right, the other
wrong) split unevenly. For a graded outcome (evidence recall in [0, 1]) the
same exact test is the sign test over the questions where the two differ.
Everything is seeded, so a report is reproducible to the digit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0
# A 95% interval wider than this cannot tell apart the differences a user would act on.
SEPARABLE_CI_WIDTH = 0.2


@dataclass(frozen=True)
class PairedDifference:
    """mean(a) - mean(b) over paired questions, its bootstrap CI and the exact sign/McNemar p-value."""

    n: int
    mean_a: float
    mean_b: float
    difference: float
    ci_low: float
    ci_high: float
    a_better: int  # questions where a > b (for 0/1 outcomes: a right, b wrong)
    b_better: int
    p_value: float

    @property
    def ci_width(self) -> float:
        return self.ci_high - self.ci_low

    @property
    def verdict(self) -> str:
        """"a better" / "b better" when the CI excludes 0, else "not separable at this n"."""
        if self.n == 0 or math.isnan(self.ci_low):
            return "no paired questions"
        if self.ci_low > 0:
            return "a better"
        if self.ci_high < 0:
            return "b better"
        return "not separable at this n"

    @property
    def too_small(self) -> bool:
        """True when n is too small to separate differences that matter (CI wider than SEPARABLE_CI_WIDTH)."""
        return self.n == 0 or not self.ci_width <= SEPARABLE_CI_WIDTH


def bootstrap_mean_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                      level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of `values` (resampling its entries with replacement)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return float("nan"), float("nan")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng(seed)
    # Resample in blocks so 10k questions x 4k resamples never needs one 40M-entry index array.
    means = np.empty(resamples)
    block = max(1, 2_000_000 // data.size)
    for start in range(0, resamples, block):
        stop = min(resamples, start + block)
        means[start:stop] = data[rng.integers(0, data.size, size=(stop - start, data.size))].mean(axis=1)
    alpha = (1 - level) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)


def exact_sign_test(a_better: int, b_better: int) -> float:
    """Two-sided exact binomial test of a_better vs b_better at p = 1/2 (McNemar's exact test when the
    outcomes are right/wrong). Ties (questions where both agree) do not count."""
    n = a_better + b_better
    if n == 0:
        return 1.0
    k = min(a_better, b_better)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(a: Sequence[float], b: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                      seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> PairedDifference:
    """Compare outcomes `a[i]` and `b[i]` of the same question i (0/1 correctness, or a graded score)."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)} and {len(b)}")
    first, second = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if first.size == 0:
        nan = float("nan")
        return PairedDifference(0, nan, nan, nan, nan, nan, 0, 0, 1.0)
    differences = first - second
    low, high = bootstrap_mean_ci(differences, resamples, seed, level)
    a_better, b_better = int((differences > 0).sum()), int((differences < 0).sum())
    return PairedDifference(
        n=int(first.size), mean_a=float(first.mean()), mean_b=float(second.mean()),
        difference=float(differences.mean()), ci_low=low, ci_high=high,
        a_better=a_better, b_better=b_better, p_value=exact_sign_test(a_better, b_better),
    )
