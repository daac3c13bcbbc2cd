"""Prompt plumbing shared by scorers and strategies."""

from __future__ import annotations

from metaloom.errors import InvalidParameter
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
