"""Small statistics helpers shared by the workloads and the report."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 / mean / max of a sample (seconds or counts)."""
    return {"p50": percentile(values, 50), "p99": percentile(values, 99),
            "mean": mean(values), "max": max(values) if values else None, "n": len(values)}
