"""Prompt plumbing shared by scorers and strategies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator, Scored, TokenIds
from metaloom.generator.types import Prompt as GenPrompt
from metaloom.ledger import Ledger
from metaloom.score.protocols import Prompt


def user_text(prompt: Prompt) -> str:
    """The question itself: a raw prompt, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    if not users:
        raise InvalidParameter("prompt", prompt, "a string or messages with at least one user message")
    return users[-1]


def fill(template: str, name: str, **values: str) -> str:
    """``template.format(**values)``; a template naming another field raises `InvalidParameter`."""
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise InvalidParameter(name, template, f"a template using only {{{'}, {'.join(values)}}} ({exc})") from exc


@runtime_checkable
class ScoresMany(Protocol):
    """A generator that scores several prompts' continuations in one call (`RemoteGenerator`:
    one request, whose shared beginnings a server such as metaloom serve computes once)."""

    def score_many(self, items: Sequence[tuple[GenPrompt, Sequence[str | TokenIds]]], *,
                   ledger: Ledger) -> list[list[Scored]]: ...


def score_all(generator: Generator, items: Sequence[tuple[GenPrompt, Sequence[str | TokenIds]]], *,
              ledger: Ledger) -> list[list[Scored]]:
    """`Generator.score` of each (prompt, continuations): in one call where the generator takes
    them together (`ScoresMany`), else one call per prompt (the local engine, whose prefix cache
    shares what the prompts have in common across calls)."""
    if isinstance(generator, ScoresMany):
        return generator.score_many(items, ledger=ledger)
    return [generator.score(prompt, continuations, ledger=ledger) for prompt, continuations in items]
