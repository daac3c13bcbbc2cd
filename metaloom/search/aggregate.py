"""How a path's step scores become one score (Lightman et al. 2024 take the product or the
minimum; Snell et al. 2024 and search-and-learn use the last step's score as the PRM's
"reward-to-go"; Wang et al. 2024 Math-Shepherd the minimum)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from metaloom.errors import InvalidParameter

AGGREGATIONS = ("last", "min", "product", "mean")


def check_aggregation(name: str) -> None:
    if name not in AGGREGATIONS:
        raise InvalidParameter("aggregation", name, f"one of {AGGREGATIONS}")


def aggregate(name: str, scores: Sequence[float]) -> float:
    """The score of a path whose steps scored ``scores`` (root first). An empty path scores
    0 under every rule but "product", whose empty product is 1."""
    check_aggregation(name)
    if not scores:
        return 1.0 if name == "product" else 0.0
    if name == "last":
        return float(scores[-1])
    if name == "min":
        return float(min(scores))
    if name == "product":
        return float(math.prod(scores))
    return float(sum(scores) / len(scores))
