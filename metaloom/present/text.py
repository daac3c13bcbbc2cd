"""Text from a model or a file made safe to show on one line: no character that could move the
cursor or colour the terminal (`clean`), newlines shown as ⏎ and long texts cut with …
(`one_line`)."""

from __future__ import annotations

from typing import Any

NEWLINE = "⏎"
ELLIPSIS = "…"


def clean(value: Any) -> str:
    """``value`` as text with no character that could move the cursor or colour the terminal."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else "\ufffd" for c in text)


def one_line(text: Any, width: int) -> str:
    """``text`` on one line: newlines as ⏎, tabs as spaces, other control characters as �; cut
    to ``width`` characters (the last one …)."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    text = text[: 2 * width + 2]  # enough to fill width even where \r\n becomes one character
    text = text.replace("\r\n", NEWLINE).replace("\n", NEWLINE).replace("\r", NEWLINE).replace("\t", " ")
    if not text.isprintable():
        text = "".join(c if c.isprintable() else "\ufffd" for c in text)
    if len(text) > width:
        return text[: width - 1] + ELLIPSIS if width > 0 else ""
    return text
