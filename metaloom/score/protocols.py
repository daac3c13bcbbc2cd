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


class Raw(str):
    """Text a strategy sends as it is, with no chat template: a plain completion (what
    ``metaloom run --raw`` runs, a /v1/completions prompt, a base model's few-shot text).
    ``Raw("Q: 2+2?\nA:")`` is a `str` everywhere; only `as_chat` tells it apart."""

    __slots__ = ()


def as_chat(prompt: Prompt) -> Prompt:
    """What a strategy runs on. A plain `str` is the user's message: one chat message, so the
    model's chat template applies (as ``metaloom run`` does; an instruct model given the bare
    text tends to answer nothing). `Raw` text and chat messages stay as they are, so a nested
    strategy given the outer one's prompt sees the same prompt."""
    if type(prompt) is str:
        return ({"role": "user", "content": prompt},)
    return prompt


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

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        """For each partial solution (its steps so far, each step's text with its delimiter),
        one score per step, higher is better (PRMs, checkers and judges give [0, 1]).

        ``last_only``: the caller (a tree search) already holds the scores of the earlier
        steps, so a scorer whose cost grows with the steps scored (a judge, rollouts) may
        score only the last one and return a one-element list; a scorer that scores all
        steps in one pass (a PRM) may ignore the flag. Callers read the last element."""
        ...


@runtime_checkable
class Utility(Protocol):
    @property
    def name(self) -> str: ...

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        """Matrix ``u[i][j] = utility(hypotheses[i], references[j])``; higher is better."""
        ...
