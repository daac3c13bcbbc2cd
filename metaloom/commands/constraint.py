"""Constraint and token-healing flags (`metaloom generate`, and any command that decodes).

At most one of ``--json-schema FILE``, ``--regex PATTERN``, ``--grammar FILE`` (Lark, the
llguidance dialect), ``--choices``. ``--choices`` takes the options as separate words
(``--choices yes no "not sure"``) or as one comma-separated word (``--choices yes,no,maybe``):
a single value is split on commas, several values are taken as given (so a choice that
contains a comma needs at least two values). ``--token-healing`` backs the prompt up over its
last token; the output then starts with the removed text.
"""

from __future__ import annotations

import argparse

from metaloom.constrain.spec import ConstraintSpec
from metaloom.errors import InvalidParameter


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained decoding (llguidance)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", default=None, help="the output is JSON valid under this JSON Schema")
    one.add_argument("--regex", metavar="PATTERN", default=None, help="the whole output matches this regular expression")
    one.add_argument("--grammar", metavar="FILE", default=None, help="the output matches this Lark grammar")
    one.add_argument("--choices", nargs="+", metavar="CHOICE", default=None,
                     help="the output is exactly one of these (one value: split on commas)")
    g.add_argument("--token-healing", action="store_true",
                   help="back the prompt up over its last token and make the output extend the removed text")


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InvalidParameter(flag, path, f"a readable file ({exc.strerror})") from exc


def constraint_spec(args: argparse.Namespace) -> ConstraintSpec | None:
    """The spec the flags ask for (shape-checked; compiled later against the tokenizer)."""
    if getattr(args, "json_schema", None) is not None:
        return ConstraintSpec.json_schema(_read("json_schema", args.json_schema))
    if getattr(args, "regex", None) is not None:
        return ConstraintSpec.regex(args.regex)
    if getattr(args, "grammar", None) is not None:
        return ConstraintSpec.lark(_read("grammar", args.grammar))
    choices = getattr(args, "choices", None)
    if choices is not None:
        options = choices[0].split(",") if len(choices) == 1 else choices
        return ConstraintSpec.choices(options)
    return None
