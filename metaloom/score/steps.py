"""Which steps a step scorer scores, and its answers put back per partial solution: shared by
the step scorers that ask one question per step (the judge, rollouts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def asked_steps(partial_steps: Sequence[Sequence[str]], last_only: bool) -> list[tuple[int, int]]:
    """(partial index, step index) of every step to score: each partial's last step when
    ``last_only``, else all of them; in order."""
    return [(i, j) for i, steps in enumerate(partial_steps)
            for j in (range(max(len(steps) - 1, 0), len(steps)) if last_only else range(len(steps)))]


def regroup(values: Sequence[T], asked: Sequence[tuple[int, int]], partials: int) -> list[list[T]]:
    """``values[k]`` (the answer for ``asked[k]``) gathered into one list per partial."""
    out: list[list[T]] = [[] for _ in range(partials)]
    for (i, _), v in zip(asked, values, strict=True):
        out[i].append(v)
    return out
