"""`ConstraintSpec`: what a request asks its output to match, as plain hashable data.

Nothing here imports the grammar engine: a spec can be built, validated for shape, compared
and hashed (a compile cache key) without llguidance installed. `metaloom.constrain.grammar`
compiles it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from metaloom.errors import InvalidGrammar

Kind = Literal["json_schema", "regex", "lark", "choices"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "lark", "choices")


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint. ``source`` is the schema as JSON text in its declared key order
    (``json_schema``), the pattern (``regex``, Rust `regex` syntax, matched against the whole
    output), the grammar text (``lark``, llguidance's Lark dialect), or the options
    (``choices``: the output is exactly one of them). Build with the class methods."""

    kind: Kind
    source: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidGrammar(str(self.kind), f"unknown kind; allowed {', '.join(KINDS)}")
        if self.kind == "choices":
            if not isinstance(self.source, tuple) or not all(isinstance(c, str) for c in self.source):
                raise InvalidGrammar("choices", f"{self.source!r} is not a tuple of strings")
            if not self.source:
                raise InvalidGrammar("choices", "the list of choices is empty")
            if any(c == "" for c in self.source):
                raise InvalidGrammar("choices", "a choice is the empty string")
        elif not isinstance(self.source, str):
            raise InvalidGrammar(self.kind, f"{self.source!r} is not a string")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> ConstraintSpec:
        """A JSON Schema given as a mapping or as JSON text.

        Keys keep their declared order (no sorting): the order of ``properties`` is the order
        the keys are generated in, so a ``reasoning`` declared before ``answer`` comes first.
        The text is otherwise canonical (``json.dumps``' fixed separators; the whitespace of JSON
        text input is dropped), so the same schema gives equal, equally hashed specs; the same
        keys in another order are a different spec (and a different compile-cache entry)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidGrammar("json_schema", f"not JSON: {exc}") from exc
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidGrammar("json_schema", f"a schema is a JSON object or boolean, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> ConstraintSpec:
        return cls("lark", grammar)

    @classmethod
    def choices(cls, options: Iterable[str]) -> ConstraintSpec:
        return cls("choices", tuple(options))
