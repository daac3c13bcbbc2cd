"""What a meta-strategy is and what it returns.

A strategy calls a `Generator` (and scorers) many times and never touches a tensor, so the
same strategy runs on the local engine, a remote server or a scripted generator (DESIGN.md;
Welleck et al. 2024, "From Decoding to Meta-Generation").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from metaloom.generator.types import Completion, Generator
from metaloom.ledger import Ledger, Usage
from metaloom.score.protocols import Prompt


@dataclass(frozen=True)
class Event:
    """One step of a strategy's run, for the trace: ``kind`` names it ("sample", "score",
    "vote", "prune", "budget", ...), ``data`` holds JSON-friendly details."""

    kind: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.data}


@dataclass(frozen=True)
class Result:
    """The outcome of one strategy run.

    ``candidates[i]`` has score ``scores[i]`` (empty when the strategy does not score) and
    extracted answer ``answers[i]`` (empty when it extracts none). ``best`` is the chosen
    output text and ``best_index`` the candidate it came from (``None`` when there is no
    candidate, e.g. a budget stop before the first sample finished). ``usage`` is what this
    run charged, its children included. ``stopped_reason`` is ``None`` for a normal finish,
    "budget" when a `Budget` limit stopped it early.
    """

    best: str
    candidates: tuple[Completion, ...] = ()
    scores: tuple[float, ...] = ()
    answers: tuple[str | None, ...] = ()
    usage: Usage = field(default_factory=Usage)
    trace: tuple[Event, ...] = ()
    stopped_reason: str | None = None
    best_index: int | None = None

    @property
    def answer(self) -> str | None:
        """The extracted answer of the chosen candidate, when the strategy extracts answers."""
        if self.best_index is None or not self.answers:
            return None
        return self.answers[self.best_index]

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "answer": self.answer,
            "best_index": self.best_index,
            "candidates": [{"text": c.text, "tokens": len(c.token_ids),
                            "logprob": c.logprob if math.isfinite(c.logprob) else None,  # strict JSON has no NaN
                            "finish_reason": c.finish_reason} for c in self.candidates],
            "scores": [s if math.isfinite(s) else None for s in self.scores],  # None: unscored
            "answers": list(self.answers),
            "usage": self.usage.to_dict(),
            "trace": [e.to_dict() for e in self.trace],
            "stopped_reason": self.stopped_reason,
        }


@runtime_checkable
class Strategy(Protocol):
    """A frozen config dataclass with ``run``. It charges everything it spends to ``ledger``
    (nested strategies to ``ledger.child()``) and stops cleanly on `BudgetExceeded`."""

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        ...


def usage_dict(usage: Usage) -> dict[str, Any]:
    """Usage without the zero fields, for compact trace events."""
    return {k: v for k, v in usage.to_dict().items() if v is None or v}
