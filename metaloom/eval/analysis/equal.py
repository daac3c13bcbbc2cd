"""Each single-run strategy against every sampling curve at the same compute.

A tree search, an adaptive vote or greedy is one point: an accuracy at a mean cost. A pooled
strategy is a curve (N = 1, 2, 4, ...). "Does the search beat best-of-N at equal FLOPs?" is
the curve's accuracy at the point's cost: read off between the two curve points that bracket
that cost, linearly in log cost (the axis on which coverage grows about linearly in N, Brown
et al. 2024), over the problems the point and the curve share. Outside the curve's measured
range the answer is None: a curve is never extrapolated.

The difference is paired: per problem, the point's correctness minus the curve's interpolated
expected correctness (the same interpolation weight on both bracketing points), with a
percentile bootstrap 95% interval over problems (`curves.interval`), so "+10 points" comes
with how sure it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from metaloom.eval.analysis.curves import Point, interval

# costs this close (relative) are one cost: a search charged exactly the FLOPs of the curve's last
# point had its mean summed in another order and came out an ulp above it, "beyond the curve"
SAME_COST = 1e-9


def bracket(costs: Sequence[float], cost: float) -> tuple[int, int, float] | None:
    """Indices (i, j) into ascending ``costs`` with costs[i] <= cost <= costs[j], and the weight
    w of j in log cost; None when ``cost`` is outside [costs[0], costs[-1]] or not positive. A
    cost within `SAME_COST` (relative) of a curve point is that point's."""
    if not costs or not cost > 0 or costs[0] <= 0:
        return None
    for k, c in enumerate(costs):
        if abs(cost - c) <= SAME_COST * c:
            return k, k, 0.0
    if cost < costs[0] or cost > costs[-1]:
        return None
    for j in range(len(costs)):
        if costs[j] >= cost:
            if j == 0 or costs[j] == cost:
                return j, j, 0.0
            i = j - 1
            w = (math.log(cost) - math.log(costs[i])) / (math.log(costs[j]) - math.log(costs[i]))
            return i, j, w
    return None


def at_equal_compute(pts: Sequence[Point], *, metric: str = "flops", seed: int = 0,
                     bootstrap: int = 1000) -> list[dict[str, Any]]:
    """One row per (single point, pooled family) pair: the point's accuracy and mean ``metric``
    cost, the family's interpolated accuracy at that cost (None outside its range, with the
    reason), the paired difference and its bootstrap interval, over the problems both share."""
    singles = [p for p in pts if p.k is None]
    fams: dict[str, list[Point]] = {}
    for p in pts:
        if p.k is not None:
            fams.setdefault(p.family, []).append(p)
    rows: list[dict[str, Any]] = []
    for s in singles:
        for fam, curve in fams.items():
            shared = [q for q in s.problems if all(c.covers(q) for c in curve)]
            row: dict[str, Any] = {"strategy": s.label, "family": fam, "problems": len(shared), "metric": metric,
                                   "accuracy": None, "cost": None, "family_accuracy": None, "difference": None,
                                   "difference_lo": None, "difference_hi": None, "between": None, "reason": None}
            rows.append(row)
            if not shared:
                row["reason"] = "no problem in common"
                continue
            cost = s.mean_cost(metric, shared)
            row.update(accuracy=s.accuracy(shared), cost=cost)
            ordered = sorted(curve, key=lambda c: c.mean_cost(metric, shared))
            costs = [c.mean_cost(metric, shared) for c in ordered]
            if not all(math.isfinite(c) for c in [cost, *costs]):
                row["reason"] = f"{metric} unknown"
                continue
            if not (cost > 0 and costs[0] > 0):
                row["reason"] = f"no positive {metric} to place on a log axis"
                continue
            found = bracket(costs, cost)
            if found is None:
                row["reason"] = (f"below the curve's cheapest point ({ordered[0].label})" if cost < costs[0]
                                 else f"beyond the curve's largest point ({ordered[-1].label})")
                continue
            i, j, w = found
            lo, hi = ordered[i], ordered[j]
            theirs = (1 - w) * lo.correct[lo.among(shared)] + w * hi.correct[hi.among(shared)]
            diff = s.correct[s.among(shared)] - theirs
            d_lo, d_hi = interval(diff, seed=seed, bootstrap=bootstrap)
            row.update(family_accuracy=float(theirs.mean()), difference=float(np.mean(diff)), difference_lo=d_lo,
                       difference_hi=d_hi, between=[lo.label, hi.label] if i != j else [lo.label])
    return rows
