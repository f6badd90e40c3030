"""Small statistics for paired comparisons over evaluation windows (no scipy needed).

The unit of replication is the *window*: tokens inside one window are strongly correlated (they
share the cache that quantization perturbs), so intervals are computed over per-window means.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

# two-sided 95% Student-t critical values, df = 1..30 (beyond: normal approximation)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Two-sided 95% critical value of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.96 + 2.4 / df  # within 0.002 of the exact value for df > 30


@dataclass(frozen=True)
class Interval:
    """Mean of per-window values with a 95% t-interval (``lo == hi == mean`` for one window)."""

    mean: float
    lo: float
    hi: float
    se: float
    n: int

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 8) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def mean_interval(values: Sequence[float]) -> Interval:
    """95% t-interval for the mean of ``values`` (one value per window)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, mean, mean, 0.0, 1)
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    se = math.sqrt(var / n)
    half = t975(n - 1) * se
    return Interval(mean, mean - half, mean + half, se, n)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], reps: int = 4000,
                    seed: int = 0) -> tuple[float, float, float]:
    """``(ratio of means, 2.5%, 97.5%)`` of ``mean(num) / mean(den)``, resampling windows jointly.

    ``num`` and ``den`` are paired per-window values (same windows). Resamples whose denominator
    mean is not positive are dropped (the ratio is meaningless there).
    """
    if len(num) != len(den) or not num:
        raise ValueError("num and den must be non-empty and of equal length")
    n = len(num)
    point = (sum(num) / n) / (sum(den) / n) if sum(den) > 0 else math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        d = sum(den[i] for i in idx)
        if d > 0:
            ratios.append(sum(num[i] for i in idx) / d)
    if not ratios:
        return point, math.nan, math.nan
    ratios.sort()
    return point, ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]
