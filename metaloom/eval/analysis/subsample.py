"""Re-picking within a subset of a pooled record's candidates: what the strategy would have
chosen had it drawn only those samples, and what they cost.

Why: a sampling strategy's N samples are i.i.d. draws, so any k of them (in a random order)
are a draw of the same strategy at N=k; its accuracy at N=k is the expectation over those
ordered subsets (`outcome`: exact for majority vote and best-of-N, `metaloom.eval.analysis.exact`).
Reading smaller N off the largest N costs no model calls and lowers variance (every N sees
the same pool). The rules here are the strategies' own, tie rules included
(`metaloom.meta.voting.decide`, `metaloom.meta.helpers.select_top`, `metaloom.meta.mbr.MBR`,
`metaloom.score.mbr.mbr_select`), so ``pick`` over the first k
candidates in draw order is what the strategy chose when it drew exactly those k.

- ``majority_vote``: the class with most votes wins, ties to the class seen first (in subset
  order); its first sample is the output. No answer at all: the first candidate.
- ``weighted_vote``: each vote weighs its score (``identity``) or ``exp(score - max score)``
  (``exp``), summed per class in subset order; the heaviest class wins (ties: seen first); its
  heaviest sample is the output (ties: earliest). No answer at all: the first candidate.
- ``best_of_n``: the top score, earliest on ties.
- ``mbr``: expected utility of each sample against the subset, references weighted by their
  multiplicity (Σ_j count_j/k · u(i, j), summed exactly as `mbr_select` does with ``fsum``); the
  highest wins, earliest on ties.

`pick_many` is the same rule over many subsets at once (numpy), exact: integer counts for
majority vote, the same sequential float additions for weighted vote, exact comparisons for
best-of-N, and for MBR a float matrix product whose near-ties (where rounding could differ
from ``fsum``) are re-decided by `pick`.

Coverage (pass@k): the probability that at least one of k samples is correct, estimated
without bias from n ≥ k samples with c correct as 1 - C(n-c, k)/C(n, k) (Chen et al. 2021,
"Evaluating Large Language Models Trained on Code"; as coverage in Brown et al. 2024, "Large
Language Monkeys").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.exact import exact_correct
from metaloom.eval.records import POOLED, Record, Selection

# what a point costs, per problem: each is an x axis of the curves. ``kv_bytes_peak`` is the most
# KV memory the run held at once (`metaloom.ledger`), a peak where the others are totals
COSTS = ("output_tokens", "flops", "seconds", "kv_bytes_peak")
TRANSFORMS = ("identity", "exp")
_NEAR = 1e-9  # relative gap under which a float-matrix MBR decision is re-made exactly


def selection_of(record: Record) -> Selection:
    """The record's `Selection`, checked against its candidates: a `POOLED` kind, one group per
    candidate where the kind needs groups, a square matrix covering every group for MBR, a
    known transform for weighted vote. Anything else is an `InvalidParameter` naming the record."""
    where = f"selection of {record.problem!r} / {record.strategy!r}"
    sel = record.selection
    if sel is None:
        raise InvalidParameter(where, None, "a Selection (a pooled record with candidates)")
    if sel.kind not in POOLED:
        raise InvalidParameter(f"{where}: kind", sel.kind, f"one of {POOLED}")
    n = len(record.candidates)
    if sel.kind in ("majority_vote", "weighted_vote", "mbr") and len(sel.groups) != n:
        raise InvalidParameter(f"{where}: groups", len(sel.groups), f"one group per candidate ({n})")
    if sel.kind == "weighted_vote" and (sel.transform or "identity") not in TRANSFORMS:
        raise InvalidParameter(f"{where}: transform", sel.transform, f"one of {TRANSFORMS}")
    if sel.kind == "mbr":
        size = len(sel.matrix)
        if any(g is None or not 0 <= g < size for g in sel.groups) or any(len(row) != size for row in sel.matrix):
            raise InvalidParameter(f"{where}: matrix", (size, sel.groups), "a square matrix with a row per distinct text")
    return sel


def _check_subset(record: Record, subset: Sequence[int]) -> list[int]:
    idx = [int(i) for i in subset]
    n = len(record.candidates)
    if any(not 0 <= i < n for i in idx) or len(set(idx)) != len(idx):
        raise InvalidParameter("subset", list(subset), f"distinct candidate indices in [0, {n})")
    return idx


def _vote(groups: Sequence[int | None], weights: Sequence[float]) -> int:
    """`metaloom.meta.voting.decide` over positions: the position of the chosen sample."""
    slots: dict[int, int] = {}  # group -> class slot, in order of first appearance
    totals: list[float] = []
    members: list[list[int]] = []
    for pos, (g, w) in enumerate(zip(groups, weights, strict=True)):
        if g is None:
            continue
        if g not in slots:
            slots[g] = len(totals)
            totals.append(0.0)
            members.append([])
        totals[slots[g]] += w
        members[slots[g]].append(pos)
    if not totals:
        return 0  # no answer at all: the first candidate is kept
    win = min(range(len(totals)), key=lambda s: (-totals[s], s))
    return min(members[win], key=lambda p: (-weights[p], p))


def _exp_weights(scores: Sequence[float]) -> list[float]:
    top = max(scores)  # shift before exp, as WeightedVote does: same ranking, no underflow
    return [math.exp(s - top) if math.isfinite(top) else 0.0 for s in scores]


def _first_top(scores: Sequence[float]) -> int:
    """`select_top(scores)[0]`: the highest, earliest on ties."""
    return min(range(len(scores)), key=lambda i: (-scores[i], i))


def _mbr_scores(sel: Selection, groups: Sequence[int]) -> list[float]:
    """Each position's expected utility against the subset, computed as `MBR.run` does:
    distinct texts in order of first appearance, references weighted by multiplicity."""
    counts: dict[int, int] = {}
    for g in groups:
        counts[g] = counts.get(g, 0) + 1
    distinct = list(counts)
    w = [float(counts[d]) for d in distinct]
    total = math.fsum(w)
    w = [x / total for x in w]
    expected = {a: math.fsum(wj * float(sel.matrix[a][b]) for wj, b in zip(w, distinct, strict=True)) for a in distinct}
    return [expected[g] for g in groups]


def pick(record: Record, subset: Sequence[int]) -> int | None:
    """The index (into ``record.candidates``) of the candidate the record's strategy picks when
    it has drawn exactly ``subset``, in that order (ties depend on the order). None when the
    subset is empty, or when the strategy could not choose: a scored kind (best-of-N, weighted
    vote) with a candidate that has no score (the run stopped before scoring: it chose nothing).
    Rules: see the module docstring. Unknown kind: `InvalidParameter`."""
    sel = selection_of(record)
    idx = _check_subset(record, subset)
    if not idx:
        return None
    cands = record.candidates
    if sel.kind == "majority_vote":
        return idx[_vote([sel.groups[i] for i in idx], [1.0] * len(idx))]
    if sel.kind == "mbr":
        return idx[_first_top(_mbr_scores(sel, [int(sel.groups[i]) for i in idx]))]  # type: ignore[arg-type]
    raw = [cands[i].score for i in idx]
    if any(s is None for s in raw):
        return None
    scores = [float(s) for s in raw]  # type: ignore[arg-type]
    if sel.kind == "best_of_n":
        return idx[_first_top(scores)]
    weights = _exp_weights(scores) if sel.transform == "exp" else scores
    return idx[_vote([sel.groups[i] for i in idx], weights)]


def _first_positions(g: np.ndarray, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(members, first): ``members[d, p, c]`` whether position p of row d is in class c, and
    ``first[d, c]`` the first such position (k where absent)."""
    k = g.shape[1]
    members = g[:, :, None] == np.arange(classes)[None, None, :]
    first = np.where(members.any(axis=1), members.argmax(axis=1), k)
    return members, first


def _pick_votes(record: Record, sel: Selection, sub: np.ndarray) -> np.ndarray:
    rows, k = sub.shape
    groups = np.array([-1 if g is None else int(g) for g in sel.groups], dtype=np.int64)
    g = groups[sub]
    classes = int(groups.max()) + 1 if groups.size else 0
    out = np.zeros(rows, dtype=np.int64)  # no answer at all: position 0
    if classes == 0:
        return sub[:, 0].copy()
    members, first = _first_positions(g, classes)
    present = first < k
    if sel.kind == "majority_vote":
        counts = members.sum(axis=1)
        key = np.where(present, counts * (k + 1) + (k - first), -1)  # most votes, then seen first
        win = key.argmax(axis=1)
        out = first[np.arange(rows), win]
    else:
        scores = np.array([c.score for c in record.candidates], dtype=np.float64)
        s = scores[sub]
        if sel.transform == "exp":  # math.exp, as WeightedVote: numpy's exp may differ in the last bit
            top = s.max(axis=1)
            w = np.empty_like(s)
            for t in np.unique(top):  # few distinct maxima: one column of weights each
                col = np.array([math.exp(a - t) if math.isfinite(t) else 0.0 for a in scores])
                w[top == t] = col[sub[top == t]]
        else:
            w = s
        totals = np.zeros((rows, classes))
        for p in range(k):  # sequential adds in subset order: the same floats as decide's loop
            valid = g[:, p] >= 0
            totals[valid, g[valid, p]] += w[valid, p]
        masked = np.where(present, totals, -np.inf)
        best = masked.max(axis=1, keepdims=True)
        win = np.where(present & (masked == best), first, k + 1).argmin(axis=1)  # ties: seen first
        mine = g == win[:, None]
        top_w = np.where(mine, w, -np.inf).max(axis=1, keepdims=True)
        out = (mine & (w == top_w)).argmax(axis=1)  # heaviest member, earliest on ties
    none = ~present.any(axis=1)
    out[none] = 0
    return sub[np.arange(rows), out]


def _pick_mbr(record: Record, sel: Selection, sub: np.ndarray) -> np.ndarray:
    rows, k = sub.shape
    groups = np.array(sel.groups, dtype=np.int64)
    u = np.array(sel.matrix, dtype=np.float64)
    g = groups[sub]
    counts = np.zeros((rows, len(u)))
    np.add.at(counts, (np.repeat(np.arange(rows), k), g.ravel()), 1.0)
    expected = (counts / k) @ u.T  # expected[d, a] = Σ_b w_b u[a, b]
    s = expected[np.arange(rows)[:, None], g]
    top = s.max(axis=1, keepdims=True)
    tol = _NEAR * (1.0 + float(np.abs(u).max(initial=0.0)))
    near = s >= top - tol
    g_near = np.where(near, g, -1)
    ambiguous = (np.where(near, g, g.max(initial=0) + 1).min(axis=1) != g_near.max(axis=1))
    out = sub[np.arange(rows), near.argmax(axis=1)]  # one text near the top: its first sample
    for d in np.flatnonzero(ambiguous):  # texts within rounding of each other: decide exactly
        out[d] = pick(record, sub[d].tolist())
    return out


def pick_many(record: Record, subsets: np.ndarray) -> np.ndarray:
    """`pick` for each row of ``subsets`` (an int array, rows x k, k >= 1), vectorised; -1
    where `pick` is None. Equal to ``[pick(record, row) for row in subsets]``."""
    sel = selection_of(record)
    sub = np.asarray(subsets, dtype=np.int64)
    n = len(record.candidates)
    if sub.ndim != 2 or sub.shape[1] == 0 or (sub.size and (sub.min() < 0 or sub.max() >= n)):
        raise InvalidParameter("subsets", sub.shape, f"a rows x k array (k >= 1) of candidate indices in [0, {n})")
    if sub.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    if sel.kind == "mbr":
        return _pick_mbr(record, sel, sub)
    if sel.kind == "majority_vote":
        return _pick_votes(record, sel, sub)
    raw = [c.score for c in record.candidates]
    if any(s is None or math.isnan(s) for s in raw):  # rare: decide row by row
        return np.array([-1 if (p := pick(record, row.tolist())) is None else p for row in sub], dtype=np.int64)
    if sel.kind == "best_of_n":
        s = np.array(raw, dtype=np.float64)[sub]
        return sub[np.arange(sub.shape[0]), s.argmax(axis=1)]  # argmax: the first of the maxima
    return _pick_votes(record, sel, sub)


def _num(value: object) -> float:
    """A usage figure; None (unknown, e.g. FLOPs behind a remote server) is NaN."""
    return float(value) if isinstance(value, int | float) else math.nan


def subset_cost(record: Record, subset: Sequence[int]) -> dict[str, float]:
    """What drawing only ``subset`` would have cost: ``shared`` (the prefill, scorer calls over
    the set — what no single sample caused; `metaloom.eval.pool`) plus the subset's candidates'
    own output tokens, FLOPs, seconds and KV memory (the prompt's share of the peak plus each
    sample's own, as `metaloom.eval.pool` attributes it). Unknown figures are NaN."""
    idx = _check_subset(record, subset)
    cands = record.candidates
    return {
        "output_tokens": _num(record.shared.get("output_tokens", 0.0)) + sum(cands[i].tokens for i in idx),
        "flops": _num(record.shared.get("flops", 0.0)) + math.fsum(_num(cands[i].flops) for i in idx),
        "seconds": _num(record.shared.get("seconds", 0.0)) + math.fsum(cands[i].seconds for i in idx),
        "kv_bytes_peak": _num(record.shared.get("kv_bytes_peak")) + math.fsum(_num(cands[i].kv_bytes) for i in idx),
    }


def record_cost(record: Record) -> dict[str, float]:
    """A whole run's cost from its usage: output tokens, FLOPs, seconds (the ledger's seconds;
    the record's wall-clock ``seconds`` where the usage has none), peak KV bytes. Unknown
    figures (and a peak a record written before it was measured lacks) are NaN."""
    usage = record.usage
    seconds = usage.get("seconds") if usage.get("seconds") is not None else record.seconds
    return {"output_tokens": _num(usage.get("output_tokens")), "flops": _num(usage.get("flops")), "seconds": _num(seconds),
            "kv_bytes_peak": _num(usage.get("kv_bytes_peak"))}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k)/C(n, k)
    (Chen et al. 2021), as the product 1 - Π_{i=n-c+1}^{n} (1 - k/i): no huge binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise InvalidParameter("pass_at_k", (n, c, k), "0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def draw_subsets(n: int, k: int, draws: int, rng: np.random.Generator) -> np.ndarray:
    """Subsets of min(k, n) of n candidates, each in a random order, as a rows x k array: each
    candidate alone when k == 1 or n == 1 (the exact average); else ``draws`` uniformly random
    ordered k-subsets (without replacement within a row). At k = n too: the samples are
    exchangeable, so the expectation averages over their order (ties depend on it) rather
    than reading the one order the run happened to draw."""
    k = min(k, n)
    if k == 1:
        return np.arange(n, dtype=np.int64)[:, None]
    return np.argsort(rng.random((draws, n)), axis=1)[:, :k].astype(np.int64)


def subset_rng(seed: int, problem: str, k: int) -> np.random.Generator:
    """The draws for (problem, k): the same subsets for every strategy spec with the same pool
    size, so their comparisons are paired (common random numbers), whatever the record order."""
    return np.random.default_rng([seed, zlib.crc32(problem.encode()), k])


@dataclass(frozen=True)
class Outcome:
    """One (record, k) cell: expected ``correct`` (0..1), ``coverage`` (pass@k; None for a
    strategy that is not pooled) and expected ``cost`` per `COSTS`."""

    correct: float
    coverage: float | None
    cost: Mapping[str, float]


def outcome(record: Record, k: int | None, *, seed: int = 0, draws: int = 200) -> Outcome:
    """The record at N=k: its expected correctness over ordered k-subsets of its candidates
    drawn uniformly (at k = n: over the orders of the whole pool; ties depend on the order),
    their expected cost, and pass@k. Majority vote and best-of-N: exact (`exact`: a closed
    form over every ordered subset); weighted vote and MBR: the mean over ``draws`` random
    ordered subsets (`draw_subsets`; the same subsets for every spec of the problem). The cost
    is exact for every kind: the shared part plus k/n of the candidates' own costs (each
    candidate is in a k-subset with probability k/n). ``k`` None, or a record without
    candidates (a run that failed before sampling): the record as run (coverage, where k is
    given: its own correctness). A record with fewer than k candidates (a budget stop) is read
    with all it has. A record with ``error`` set counts as incorrect (coverage 0 too) and keeps
    its cost."""
    cands = record.candidates
    failed = record.error is not None
    if k is None or not cands:
        correct = 0.0 if failed else float(record.correct)
        return Outcome(correct, None if k is None else correct, record_cost(record))
    n = len(cands)
    kk = min(k, n)
    own = {"output_tokens": [float(c.tokens) for c in cands], "flops": [_num(c.flops) for c in cands],
           "seconds": [float(c.seconds) for c in cands], "kv_bytes_peak": [_num(c.kv_bytes) for c in cands]}
    # a record without a shared peak (written before peaks were measured) has no memory cost: NaN
    shared = {name: record.shared.get(name, None if name == "kv_bytes_peak" else 0.0) for name in COSTS}
    cost = {name: _num(shared[name]) + kk / n * math.fsum(own[name]) for name in COSTS}
    if failed:
        return Outcome(0.0, 0.0, cost)
    selection_of(record)  # checked before either rule reads it
    exact = exact_correct(record, kk)
    if exact is None:
        sub = draw_subsets(n, kk, draws, subset_rng(seed, record.problem, kk))
        picked = pick_many(record, sub)
        right = np.array([c.correct for c in cands] + [False])  # index -1: no choice, incorrect
        exact = float(right[picked].mean())
    coverage = pass_at_k(n, sum(c.correct for c in cands), kk)
    return Outcome(exact, coverage, cost)
