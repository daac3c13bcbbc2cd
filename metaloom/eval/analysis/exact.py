"""Exact expectations over the order of a pool's samples, for the two strategies whose rule
allows a closed form: majority vote and best-of-N.

What is computed: a sampling strategy at N = k read off a pool of n i.i.d. samples is the
strategy run on k of them drawn without replacement, in a uniformly random order (every
ordered k-subset equally likely; at k = n, every order of the whole pool). Its expected
correctness is the mean over those ordered subsets of the correctness of what the strategy
picks. Ties make the order matter: a vote's tie goes to the answer seen first, best-of-N's tie
to the earliest top score. A record's own ``correct`` flag is the pick in the one order the
run drew (its first-seen pick), one draw of this expectation, not the expectation.

**Majority vote.** The drawn samples form per-class counts X_1..X_m (multivariate
hypergeometric; samples without an answer cast no vote). Class c wins when X_c = j ≥ 1, every
other class has at most j, and, when t others also have j, c's first sample comes before
theirs. In a uniformly random order the first of the (t + 1)·j tied samples is uniform among
them, so each tied class wins with probability j / ((t + 1)·j) = 1/(t + 1). So

    P(c wins) = Σ_j Σ_t C(a_c, j) · W_c(j, t) / C(n, k) · 1/(t + 1)

where W_c(j, t) counts the ways to draw the other k − j samples with every other class at
most j and exactly t of them at j: the coefficient of z^(k−j) y^t in the product, over the
other classes i, of Σ_{x<j} C(a_i, x) z^x + C(a_i, j) z^j y (classes with a_i < j, and the
answer-less samples, contribute (1 + z)^a_i, folded into one binomial row). The winner's
output is its first sample, uniform among its drawn members, hence among its a_c pool members:
the class contributes P(c wins) · (its correct members / a_c). No answer drawn at all (the
vote keeps the first sample, an answer-less one): C(a_0, k) / C(n, k) times the answer-less
samples' correct fraction.

**Best-of-N.** With the scores' distinct levels ordered, the top level drawn is L with
probability [C(n_≤L, k) − C(n_<L, k)] / C(n, k); the earliest of the drawn level-L samples
is picked, uniform among them, hence among level L's pool members. A sample without a score
makes the strategy choose nothing (incorrect): only subsets of the scored samples count.
With an exact checker as the scorer (correct samples alone at the top) this is pass@k.

Weighted vote and MBR sum floats per class, where no such form holds: `subsample.outcome`
averages them over random ordered subsets.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from metaloom.eval.records import Record

EXACT = ("majority_vote", "best_of_n")


def _comb_row(n: int, k: int) -> np.ndarray:
    """C(n, x) for x = 0..k as floats (exact below 2^53, and well within range for the pool
    sizes of a sweep: C(1024, 512) ~ 4e306)."""
    return np.array([float(math.comb(n, x)) for x in range(k + 1)], dtype=np.float64)


def vote_win(counts: Sequence[int], free: int, k: int) -> list[float]:
    """P(class c wins) for each class of a majority vote over k samples drawn uniformly without
    replacement, in random order, from a pool with ``counts[c]`` samples of answer class c and
    ``free`` samples without an answer (ties: the class seen first). See the module docstring."""
    n = sum(counts) + free
    if any(a < 0 for a in counts) or free < 0 or not 1 <= k <= n:
        raise ValueError(f"counts {list(counts)}, free {free}, k {k}: need non-negative counts and 1 <= k <= n")
    total = float(math.comb(n, k))
    by_count: dict[int, list[int]] = defaultdict(list)
    for c, a in enumerate(counts):
        by_count[a].append(c)
    out = [0.0] * len(counts)
    for a, members in by_count.items():
        if a == 0:
            continue
        others = [b for c, b in enumerate(counts) if c != members[0]]  # the class's rivals (same for each member)
        out_a = 0.0
        for j in range(1, min(a, k) + 1):
            rest = k - j
            capped = [b for b in others if b >= j]  # rivals that could reach j: tracked
            loose = free + sum(b for b in others if b < j)  # can never tie or beat j: one binomial row
            poly = np.zeros((rest + 1, len(capped) + 1))
            poly[:, 0] = _comb_row(loose, rest)
            for t, b in enumerate(capped):
                term = _comb_row(b, j)
                new = np.zeros_like(poly)
                for x in range(min(j, rest + 1)):  # x < j samples of this rival: no tie
                    new[x:, : t + 1] += term[x] * poly[: rest + 1 - x, : t + 1]
                if j <= rest:  # exactly j: one more tied rival
                    new[j:, 1: t + 2] += term[j] * poly[: rest + 1 - j, : t + 1]
                poly = new
            ways = float(np.sum(poly[rest] / np.arange(1, len(capped) + 2)))
            out_a += math.comb(a, j) * ways
        for c in members:
            out[c] = out_a / total
    return out


def majority_expected(record: Record, k: int) -> float:
    """Expected correctness of majority vote at N = k over ordered k-subsets of the record's
    candidates (k > n: all of them); see the module docstring."""
    sel = record.selection
    assert sel is not None and sel.kind == "majority_vote"
    cands = record.candidates
    n = len(cands)
    k = min(k, n)
    classes: dict[int, list[bool]] = {}
    free: list[bool] = []
    for g, c in zip(sel.groups, cands, strict=True):
        (free if g is None else classes.setdefault(int(g), [])).append(bool(c.correct))
    members = list(classes.values())
    # only a class with a correct member adds to the expectation: skip the DP for the rest
    counts = [len(m) for m in members]
    win = vote_win(counts, len(free), k) if any(any(m) for m in members) else [0.0] * len(members)
    expected = math.fsum(p * sum(m) / len(m) for p, m in zip(win, members, strict=True))
    if free and any(free):
        expected += math.comb(len(free), k) / math.comb(n, k) * sum(free) / len(free)
    return expected


def best_of_n_expected(record: Record, k: int) -> float | None:
    """Expected correctness of best-of-N at N = k over ordered k-subsets (see the module
    docstring); None where a score is NaN (no order-free rule: the caller samples)."""
    cands = record.candidates
    n = len(cands)
    k = min(k, n)
    scored = [(float(c.score), bool(c.correct)) for c in cands if c.score is not None]
    if any(math.isnan(s) for s, _ in scored):
        return None
    levels: dict[float, list[bool]] = defaultdict(list)
    for s, right in scored:
        levels[s].append(right)
    total = math.comb(n, k)
    below = 0
    expected = 0.0
    for s in sorted(levels):
        here = levels[s]
        top = math.comb(below + len(here), k) - math.comb(below, k)  # subsets of scored samples topping at s
        expected += top / total * sum(here) / len(here)
        below += len(here)
    return expected


def exact_correct(record: Record, k: int) -> float | None:
    """The record's exact expected correctness at N = k, or None where its kind has no closed
    form here (weighted vote, MBR) or a score is NaN."""
    sel = record.selection
    if sel is None or not record.candidates:
        return None
    if sel.kind == "majority_vote":
        return majority_expected(record, k)
    if sel.kind == "best_of_n":
        return best_of_n_expected(record, k)
    return None
