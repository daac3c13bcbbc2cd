"""The text of one cell of the report: a figure formatted, with "–" (`MISSING`) where nobody
measured it (the terminal's `metaloom.present.numbers` says "?" or shows the value as it is),
and texts cut to `TEXT_CAP` characters with how much was cut."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from metaloom.eval.records import Record
from metaloom.present import numbers
from metaloom.present.numbers import finite

TEXT_CAP = 2000  # characters of one text (a candidate, a chosen output, a step) shown
MISSING = "–"  # a figure nobody measured


def fmt_flops(v: Any) -> str:
    """FLOPs in engineering units (`metaloom.present.numbers.fmt_flops`)."""
    return numbers.fmt_flops(v) if finite(v) else MISSING


def fmt_bytes(v: Any) -> str:
    """Bytes in binary units (`metaloom.present.numbers.fmt_bytes`)."""
    return numbers.fmt_bytes(v) if finite(v) else MISSING


def fmt_tokens(v: Any) -> str:
    """A token count: an integer as it is, a mean to one decimal."""
    if not finite(v):
        return MISSING
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def run_seconds(r: Record) -> float:
    """What a run cost in seconds: the ledger's (a sample pool replayed from another run of the
    sweep is charged what drawing it took), else the record's wall time."""
    charged = r.usage.get("seconds")
    return float(charged) if isinstance(charged, int | float) else r.seconds


def fmt_seconds(v: Any) -> str:
    if not finite(v):
        return MISSING
    return f"{v:.3g} s" if abs(v) < 100 else f"{v:,.0f} s"


def fmt_pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if finite(v) else MISSING


def fmt_interval(lo: Any, hi: Any) -> str:
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]" if finite(lo) and finite(hi) else ""


def fmt_score(v: Any) -> str:
    """A score to 3 decimals (`metaloom.present.numbers.fmt_score`)."""
    return numbers.fmt_score(v) if finite(v) else MISSING


def fmt_ratio(v: Any) -> str:
    return f"×{v:.3g}" if finite(v) else MISSING


def clip(text: Any, cap: int = TEXT_CAP) -> dict[str, Any]:
    """``text`` cut to ``cap`` characters, and how many were cut (the page says so)."""
    text = "" if text is None else str(text)
    return {"text": text[:cap], "cut": max(0, len(text) - cap), "length": len(text)}


def prompt_text(prompt: Any) -> str | None:
    """A prompt as a person reads it: raw text as it is, chat messages as "role: content"."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
                           for m in prompt)
    return str(prompt)
