"""`metaloom strategies`: every strategy and component with its parameters and defaults."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("strategies", help="list meta-generation strategies, scorers, extractors, utilities, feedback")
    s.set_defaults(run=run)


def type_name(t: Any) -> str:
    from metaloom.wiring.configure import kind_of

    kind = kind_of(t)
    if kind is not None:
        name = f"<{kind[0]}>"
    elif isinstance(t, type) and not typing.get_args(t):
        name = t.__name__
    else:
        name = str(t).replace("collections.abc.", "").replace("typing.", "")
    if type(None) in typing.get_args(t):
        name += " | None" if "None" not in name else ""
    return name


def default_text(p: Any) -> str:
    from metaloom.sampling import SamplingParams
    from metaloom.wiring.configure import REQUIRED

    if p.factory is not None:
        try:
            value = p.factory()
        except Exception:  # a default from an optional module that is not installed
            return "(default unavailable here)"
    elif p.default is REQUIRED:
        return "(required)"
    else:
        value = p.default
    if isinstance(value, SamplingParams):
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                   if getattr(value, f.name) != getattr(SamplingParams(), f.name)}
        return "sampling flags (--temperature, --max-tokens, ...) default to: " + (
            " ".join(f"{k}={v}" for k, v in changed.items()) or "the usual defaults")
    return getattr(value, "name", None) or repr(value)


def summary(entry: Any) -> str:
    """The first sentence of an entry's docstring (a factory method's, else its class's)."""
    doc = entry.__doc__ or getattr(getattr(entry, "__self__", None), "__doc__", None) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def describe(title: str, table: Mapping[str, Any], resolve: Callable[[Any], Any], prefix: str) -> list[str]:
    from metaloom.sampling import SamplingParams
    from metaloom.score.public_tests import PublicTests
    from metaloom.wiring.configure import is_generator, params_of, settable

    lines = [f"{title}:"]
    for name in sorted(table):
        try:
            entry = resolve(table[name])
        except ImportError as exc:
            lines.append(f"  {name}  (unavailable: {exc})")
            continue
        lines.append(f"  {name}  {summary(entry)}")
        for p in params_of(entry):
            if is_generator(p.type) and settable(p.type):  # a second model, named like --model
                lines.append(f"      --{prefix}.{p.name}  a model (as --model names one; a model id with --backend "
                             f"openai) = {default_text(p)} (the model being run)")
            elif is_generator(p.type):
                lines.append(f"      ({p.name}: the model being run)")
            elif p.type is SamplingParams:
                lines.append(f"      {default_text(p)}")
            elif p.type is PublicTests:
                lines.append(f"      ({p.name}: the problem's public tests, from the task in metaloom eval)")
            else:
                lines.append(f"      --{prefix}.{p.name}  {type_name(p.type)} = {default_text(p)}")
    return lines


def run(args: argparse.Namespace) -> int:
    from metaloom.wiring import registry as r

    out: list[str] = []
    out += describe("strategies (metaloom run --strategy NAME)", r.STRATEGIES, r.resolve, "strategy")
    out += describe("scorers (--strategy.scorer NAME)", r.SCORERS, r.resolve, "scorer")
    out += describe("step scorers, for tree search (--strategy.step_scorer NAME)", r.STEP_SCORERS, r.resolve, "step_scorer")
    out += describe("answer extractors (--strategy.extractor NAME)", r.EXTRACTORS, r.resolve, "extractor")
    out += describe("MBR utilities (--strategy.utility NAME)", r.utilities(), r.resolve, "utility")
    out += describe("refinement feedback (--strategy.feedback NAME)", r.FEEDBACK, r.resolve, "feedback")
    print("\n".join(out))
    return 0
