"""Voting over extracted answers, shared by majority, weighted and adaptive voting.

Votes gather in equivalence classes of answers (`metaloom.score.answers.classes`); a class's
weight is the sum of its members' weights — the reasoning paths are marginalised out
(self-consistency, Wang et al. 2023; weighted voting, e.g. Li et al. 2023, and its analysis
in Wu et al. 2024, "Inference Scaling Laws")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.meta.helpers import Run
from metaloom.score.answers import Extractor, classes


@dataclass(frozen=True)
class Tally:
    """``members[k]`` are the candidate indices in class k, ``weights[k]`` its total;
    ``order`` ranks classes by weight, ties to the class seen first."""

    members: tuple[tuple[int, ...], ...]
    weights: tuple[float, ...]

    @property
    def order(self) -> list[int]:
        return sorted(range(len(self.weights)), key=lambda k: (-self.weights[k], k))


def tally(answers: Sequence[str | None], weights: Sequence[float], extractor: Extractor) -> Tally:
    ids = classes(answers, extractor)
    k = 1 + max((i for i in ids if i is not None), default=-1)
    members: list[list[int]] = [[] for _ in range(k)]
    totals = [0.0] * k
    for i, (c, w) in enumerate(zip(ids, weights, strict=True)):
        if c is not None:
            members[c].append(i)
            totals[c] += w
    return Tally(tuple(tuple(m) for m in members), tuple(totals))


def decide(run: Run, answers: Sequence[str | None], weights: Sequence[float], extractor: Extractor) -> Tally:
    """Pick the heaviest class; its representative is its heaviest member (the earliest on
    ties). With no answer at all, the first candidate is kept and the vote says so."""
    t = tally(answers, weights, extractor)
    if not t.weights:
        run.best_index = 0 if run.candidates else None
        run.event("vote", tally={}, winner=None)
        return t
    win = t.order[0]
    run.best_index = min(t.members[win], key=lambda i: (-weights[i], i))
    run.event("vote", tally={answers[m[0]]: w for m, w in zip(t.members, t.weights, strict=True)},
              winner=answers[run.best_index])
    return t
