"""Minimum Bayes risk selection (Kumar & Byrne 2004; Eikema & Aziz 2020): pick the hypothesis
with the highest expected utility against samples standing in for the model's distribution.

``mbr_select`` is the pure decision rule over a utility matrix ``u[i][j] = utility(hyp_i,
ref_j)`` (a `metaloom.score.protocols.Utility` makes one). With hypotheses and references the
same N samples the matrix includes each sample's utility against itself, as in the `mbrs`
library; leave it in or not by what you pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from metaloom.errors import InvalidParameter


def _check_matrix(u: Sequence[Sequence[float]]) -> list[list[float]]:
    rows = [[float(x) for x in row] for row in u]
    if not rows or not rows[0]:
        raise InvalidParameter("utility_matrix", u, "a non-empty N x M matrix")
    if any(len(row) != len(rows[0]) for row in rows):
        raise InvalidParameter("utility_matrix", [len(r) for r in rows], "rows of equal length")
    if not all(math.isfinite(x) for row in rows for x in row):
        raise InvalidParameter("utility_matrix", u, "finite numbers")
    return rows


def _check_weights(weights: Sequence[float], m: int) -> list[float]:
    w = [float(x) for x in weights]
    if len(w) != m:
        raise InvalidParameter("weights", len(w), f"one weight per reference ({m})")
    if not all(math.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise InvalidParameter("weights", w, "finite numbers >= 0 with a positive sum")
    total = math.fsum(w)
    return [x / total for x in w]


def mbr_select(utility_matrix: Sequence[Sequence[float]], weights: Sequence[float] | None = None) -> tuple[int, list[float]]:
    """``(index, expected)``: ``expected[i] = sum_j w_j * u[i][j]`` with ``w`` the reference
    weights normalised to sum to 1 (uniform by default; e.g. model probabilities of the
    references for the model-weighted estimator), and ``index`` its argmax, the lowest index
    among ties.

    ``utility_matrix``: N hypotheses x M references. ``weights``: M non-negative numbers.
    """
    u = _check_matrix(utility_matrix)
    m = len(u[0])
    w = [1.0 / m] * m if weights is None else _check_weights(weights, m)
    expected = [math.fsum(wj * uij for wj, uij in zip(w, row, strict=True)) for row in u]
    best = 0
    for i, e in enumerate(expected):
        if e > expected[best]:  # strict: an equal later score never displaces an earlier one
            best = i
    return best, expected
