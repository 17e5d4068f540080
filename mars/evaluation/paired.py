"""The gate's statistics: paired per-item differences, a one-sided test per check, Holm's correction over
the gate's checks, and the minimum detectable drop.

A check compares a candidate with a baseline on the same items: ``d_i = candidate_i - baseline_i``
(binary or graded scores in [0, 1]), their mean ``delta`` and its standard error ``se = sd(d) / sqrt(n)``.
It tests "the candidate is no worse than the baseline minus ``tolerance``" against "it is worse":
``z = (delta + tolerance) / se``, one-sided ``p = Phi(z)`` (normal approximation: the gate's benchmarks
have tens to hundreds of items). Several checks are one family: Holm's step-down adjustment keeps the
chance that an unchanged model fails any of them at most ``alpha``; a check fails where its adjusted p is
below ``alpha``.

The minimum detectable drop of a check is the true drop from zero that fails it with probability
``power``, at the most conservative level of the family (Bonferroni's ``alpha / m``; Holm's step-down
only ever tests at that level or a looser one): ``tolerance + (z_{1 - alpha/m} + z_power) * se``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

_NORMAL = NormalDist()


@dataclass(frozen=True)
class Paired:
    """Paired differences of one comparison: how many items, their mean difference and its standard error."""

    n: int
    delta: float
    se: float

    @classmethod
    def of(cls, candidate: dict[str, float], baseline: dict[str, float]) -> Paired:
        """The differences over the items both scored (by id)."""
        diffs = [candidate[i] - baseline[i] for i in sorted(set(candidate) & set(baseline))]
        n = len(diffs)
        if n < 2:
            return cls(n, sum(diffs) / n if n else math.nan, math.nan)
        mean = sum(diffs) / n
        var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
        return cls(n, mean, math.sqrt(var / n))

    @classmethod
    def average(cls, parts: list[Paired]) -> Paired:
        """The equally weighted mean of several benchmarks' differences; their items are distinct, so
        the variances add."""
        k = len(parts)
        return cls(sum(p.n for p in parts), sum(p.delta for p in parts) / k,
                   math.sqrt(sum(p.se ** 2 for p in parts)) / k)

    @property
    def usable(self) -> bool:
        return self.n >= 2 and not math.isnan(self.se)


def p_worse(paired: Paired, tolerance: float = 0.0) -> float:
    """One-sided p-value of "the candidate is no worse than the baseline minus ``tolerance``": small when
    the candidate is clearly worse."""
    margin = paired.delta + tolerance
    if paired.se == 0.0:  # every item moved by the same amount: no noise to weigh it against
        return 0.0 if margin < 0 else 1.0
    return _NORMAL.cdf(margin / paired.se)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: a check fails where its adjusted p is
    below alpha, and then the family-wise error rate is at most alpha."""
    m = len(p_values)
    adjusted = [1.0] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def min_detectable_drop(se: float, level: float, power: float, tolerance: float = 0.0) -> float:
    """The true drop (from zero, in score units) that a one-sided test at ``level`` detects with
    probability ``power``, given the standard error ``se`` of the mean difference."""
    return tolerance + (_NORMAL.inv_cdf(1.0 - level) + _NORMAL.inv_cdf(power)) * se
