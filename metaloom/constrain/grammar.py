"""Grammars on llguidance: compile a `ConstraintSpec` once, then one `GrammarCursor` per row.

Compilation turns each kind into an llguidance top-level grammar:

- ``json_schema``: llguidance's JSON Schema compiler, with compact default separators
  (``", "`` and ``": "``, no free whitespace: a small model otherwise spends its tokens on
  newlines); a schema may override them with an ``"x-guidance"`` key;
- ``regex``: a single regular expression matched against the whole output;
- ``lark``: llguidance's Lark dialect as given;
- ``choices``: a Lark alternation of the options as escaped string literals.

With a healing ``prefix`` (token healing, `metaloom.decode.healing`) the grammar becomes
``start: "<prefix>" @inner`` with the compiled grammar nested as ``inner``: the engine walks
token bytes across the boundary, so one token may finish the prefix and begin the grammar's
text (``"://"`` after a removed ``":"``).

A grammar that llguidance rejects, whose first mask allows no text and no end, or (Lark) whose
start rule can never finish (`metaloom.constrain.productive`: ``start: "a" start``), raises
`InvalidGrammar` here, before any model call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from metaloom.constrain.productive import unfinishable
from metaloom.constrain.spec import ConstraintSpec
from metaloom.constrain.vocab import Vocabulary, llguidance
from metaloom.errors import InvalidGrammar, InvalidParameter

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _entry(spec: ConstraintSpec) -> dict[str, Any]:
    """The spec as one llguidance grammar entry (a dict of the top-level ``grammars`` list)."""
    llg = llguidance()
    if spec.kind == "json_schema":
        try:
            top = llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise InvalidGrammar("json_schema", str(exc)) from exc
        return json.loads(top)["grammars"][0]
    if spec.kind == "regex":
        return json.loads(llg.LLMatcher.grammar_from_regex(spec.source))["grammars"][0]
    if spec.kind == "lark":
        return {"lark_grammar": spec.source}
    return {"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in spec.source)}


def grammar_text(spec: ConstraintSpec, prefix: str = "") -> str:
    """The llguidance grammar (JSON text) for ``spec``, optionally preceded by the literal ``prefix``."""
    entry = _entry(spec)
    if not prefix:
        return json.dumps({"grammars": [entry]})
    head = {"lark_grammar": f"start: {json.dumps(prefix)} @inner"}
    return json.dumps({"grammars": [head, {**entry, "name": "inner"}]})


class CompiledGrammar:
    """A grammar compiled against one `Vocabulary`; `cursor()` gives a fresh per-row cursor
    (a copy of the compiled matcher: no recompilation)."""

    def __init__(self, spec: ConstraintSpec, vocab: Vocabulary, prefix: str = "") -> None:
        llg = llguidance()
        self.spec = spec
        self.vocab = vocab
        self.prefix = prefix
        if spec.kind == "lark" and isinstance(spec.source, str) and (stuck := unfinishable(spec.source)) is not None:
            also = f" (nor can {', '.join(stuck[1:])})" if len(stuck) > 1 else ""
            raise InvalidGrammar("lark", f"no finite text satisfies it: rule {stuck[0]!r} can never finish, every "
                                 f"alternative needing a rule that cannot{also}")
        self.text = grammar_text(spec, prefix)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.text, vocab.ll)
        if is_error:
            raise InvalidGrammar(spec.kind, one_sentence(messages[0]) if messages else "rejected by llguidance")
        matcher = llg.LLMatcher(vocab.ll, self.text, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(spec.kind, one_sentence(matcher.get_error()))
        self._template = matcher
        first = GrammarCursor(matcher.deep_copy(), vocab)
        try:
            allowed = first.mask()
        except InvalidGrammar as exc:  # the engine's state dump is for its developers, not for a client
            raise InvalidGrammar(spec.kind, "no text satisfies it (the grammar engine finds no token to start with)") from exc
        allowed[list(vocab.eos)] = False
        if not matcher.is_accepting() and not bool(allowed.any()):
            raise InvalidGrammar(spec.kind, "no text satisfies it (the first step allows no token)")

    def cursor(self) -> GrammarCursor:
        return GrammarCursor(self._template.deep_copy(), self.vocab)


def compile_constraint(spec: ConstraintSpec, vocab: Vocabulary, prefix: str = "") -> CompiledGrammar:
    return CompiledGrammar(spec, vocab, prefix)


class GrammarCursor:
    """One row's position in a grammar (an llguidance `LLMatcher`). See `metaloom.constrain`."""

    unconstrained = False

    def __init__(self, matcher: Any, vocab: Vocabulary, history: list[bool] | None = None) -> None:
        self.matcher = matcher
        self.vocab = vocab
        # one entry per advance: whether the engine recorded it (an end token after the
        # grammar has stopped is accepted but not recorded, so rollback must skip it)
        self._history: list[bool] = history if history is not None else []

    def mask(self) -> torch.Tensor:
        """Allowed next tokens, [V] bool (V = the model's vocabulary size)."""
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        out = self.vocab.from_bitmask(packed[None])[0]
        if self.matcher.is_error() or not (out.any() or self.matcher.is_stopped()):
            _engine_failed(self)
        return torch.from_numpy(out)

    def advance(self, token: int) -> None:
        """Consume ``token``; it must be allowed by `mask()`."""
        token = int(token)
        if self.matcher.is_stopped() and token in self.vocab.eos and not self.matcher.is_error():
            self._history.append(False)
            return
        if self.matcher.try_consume_tokens([token]) != 1:
            raise InvalidParameter("token", token, "a token the constraint allows at this point")
        self._history.append(True)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` `advance` calls."""
        if not 0 <= n <= len(self._history):
            raise InvalidParameter("n", n, f"0..{len(self._history)} (tokens advanced so far)")
        if n == 0:
            return
        recorded = sum(self._history[-n:])
        del self._history[-n:]
        if recorded and not self.matcher.rollback(recorded):
            raise InvalidParameter("n", n, f"a rollback the grammar engine can do ({self.matcher.get_error()})")

    def fork(self) -> GrammarCursor:
        """An independent copy at the same position."""
        return GrammarCursor(self.matcher.deep_copy(), self.vocab, list(self._history))

    def done(self) -> bool:
        """True when nothing but an end-of-sequence token may follow."""
        return bool(self.matcher.is_stopped())

    def accepting(self) -> bool:
        """True when the text so far is a complete match (an end token is allowed)."""
        return bool(self.matcher.is_accepting())


def one_sentence(message: str) -> str:
    """An engine message as one line a user can read: a regex parse error's own reason (the
    line after ``error:``), without the engine's positions, states or dumps."""
    text = message.split("<state>")[0].strip()
    reasons = [line.split("error:", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("error:")]
    first = text.splitlines()[0] if text else "rejected by the grammar engine"
    first = re.sub(r"^at \d+\(\d+\):\s*", "", first).rstrip(": ")
    if reasons:
        first = re.sub(r"\s*\(in [a-z_]+\): regex parse error$", "", first)
        return f"{first}: {reasons[0]}"
    return first


def _engine_failed(cursor: GrammarCursor) -> None:
    if cursor.matcher.is_error():
        raise InvalidGrammar("grammar", f"the grammar engine failed while decoding: {cursor.matcher.get_error().strip()}")
    raise InvalidGrammar("grammar", "the grammar engine allows no token and no end here")


def grammar_masks(cursors: Sequence[GrammarCursor], parallel: bool = False) -> np.ndarray:
    """Masks of many grammar cursors of one `Vocabulary`, [B, V] bool, written straight into
    one buffer. ``parallel``: one call to llguidance's thread pool instead of a loop (worth it
    for expensive grammars on an idle many-core machine; slower on a busy few-core one)."""
    vocab = cursors[0].vocab
    words = (vocab.tokenizer_size + 31) // 32
    packed = np.zeros((len(cursors), words), dtype=np.uint32)
    if parallel:
        vocab.executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(cursors)],
                                               packed.ctypes.data, words * 4, len(cursors))
    else:
        for i, c in enumerate(cursors):
            c.matcher.unsafe_compute_mask_ptr(packed[i].ctypes.data, words * 4)
    for c in cursors:  # a failed engine allows only the end token: that is no answer (as in `mask`)
        if c.matcher.is_error():
            _engine_failed(c)
    for i in np.flatnonzero(~packed.any(axis=1)).tolist():
        if not cursors[i].matcher.is_stopped():  # stopped with no end token in the vocabulary: nothing may follow
            _engine_failed(cursors[i])
    return vocab.from_bitmask(packed.view(np.uint8))
