"""The seams of outside information (DESIGN.md): scorers rank whole candidates, step scorers
rank partial reasoning, utilities compare hypotheses for MBR.

Candidates are `Completion`s (text, token ids, per-token log-probabilities), so a scorer can
use the model's own likelihoods as well as the text. Every call charges
``ledger.charge(scorer_calls=1)`` (plus whatever model usage the scorer itself incurs, e.g.
an LLM judge's generator usage).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from metaloom.generator.types import Completion, Message
from metaloom.ledger import Ledger

Prompt = str | tuple[Message, ...]


@runtime_checkable
class Scorer(Protocol):
    @property
    def name(self) -> str: ...

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        """One score per candidate; higher is better."""
        ...


@runtime_checkable
class StepScorer(Protocol):
    @property
    def name(self) -> str: ...

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger) -> list[list[float]]:
        """For each partial solution (a list of steps so far), one score per step."""
        ...


@runtime_checkable
class Utility(Protocol):
    @property
    def name(self) -> str: ...

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        """Matrix ``u[i][j] = utility(hypotheses[i], references[j])``; higher is better."""
        ...
