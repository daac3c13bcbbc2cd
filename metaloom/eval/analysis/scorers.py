"""How well a pooled strategy's scorer ranks its own candidates: the question behind every
best-of-N, weighted vote and MBR result, asked where it can be answered.

A scorer can only help on a *mixed* problem, one whose pool holds both correct and wrong
candidates (on the others every pick scores the same). On each mixed problem the ranking
quality is the AUROC of the candidates' scores against correctness: the chance that a random
correct candidate scores above a random wrong one, ties counting one half (0.5 = no better than
chance, 1 = every correct candidate first). It is averaged over the mixed problems, with the
strategy's own accuracy there and that of a uniformly random pick (the pool's fraction
correct) beside it: a scorer that helps lifts the first above the second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metaloom.eval.analysis.curves import latest
from metaloom.eval.records import Record


def auroc(scores: Sequence[float], correct: Sequence[bool]) -> float | None:
    """P(score of a correct candidate > score of a wrong one), ties one half; None unless both
    kinds are present."""
    pos = [s for s, c in zip(scores, correct, strict=True) if c]
    neg = [s for s, c in zip(scores, correct, strict=True) if not c]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def ranking(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Per pooled strategy whose candidates carry scores (first-seen order): ``problems`` (with
    a pool), ``mixed`` (problems with both correct and wrong scored candidates), ``auroc`` (the
    mean per-problem AUROC over the mixed ones), ``accuracy`` (the strategy's pick, correct,
    over the mixed ones) and ``random`` (a uniform pick's expected accuracy there); the three
    are None without a mixed problem."""
    by_spec: dict[str, list[Record]] = {}
    for r in latest(records).values():
        if r.error is None and r.candidates and any(c.score is not None for c in r.candidates):
            by_spec.setdefault(r.strategy, []).append(r)
    out = []
    for spec, recs in by_spec.items():
        aurocs, picks, randoms = [], [], []
        for r in recs:
            scored = [(c.score, c.correct) for c in r.candidates if c.score is not None]
            a = auroc([s for s, _ in scored], [ok for _, ok in scored])
            if a is None:
                continue
            aurocs.append(a)
            picks.append(float(r.correct))
            randoms.append(sum(bool(c.correct) for c in r.candidates) / len(r.candidates))
        out.append({"strategy": spec, "problems": len(recs), "mixed": len(aurocs), "auroc": _mean(aurocs),
                    "accuracy": _mean(picks), "random": _mean(randoms)})
    return out
