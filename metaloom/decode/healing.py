"""Token healing, and how it composes with a grammar constraint.

A prompt that ends mid-word ends on a token the model rarely sees followed by the text it
should write next: ``The url is http:`` tokenises as ``… Ġhttp :``, while the text the model
learned is ``… Ġhttp ://``. Token healing (Lundberg's guidance; Finlayson, Schoelkopf and
Welleck's tutorial "Beyond Decoding: Meta-Generation Algorithms for Large Language Models",
NeurIPS 2024) backs the prompt up over its last token and constrains the first
generated token(s) to *extend the removed text*, so the model picks the tokenisation it would
have seen (``://``) instead of being forced to continue after ``:``.

Approach:

1. `heal_prompt` removes the last prompt token (more, up to `MAX_BACKUP`, only when the removed
   bytes would otherwise end inside a UTF-8 character). Special tokens (chat markers, BOS) are
   never removed, and a one-token prompt is left as it is.
2. Without a grammar, a `HealingCursor` allows, while part of the removed text is still to be
   produced, only the tokens whose bytes start with that remainder or are a non-empty proper
   prefix of it (`Vocabulary.compatible`: a sorted-bytes range plus one probe per prefix
   length, over a per-tokenizer index built once). Once the removed text is covered the
   cursor is `unconstrained` and decoding is plain again.
3. With a grammar, the grammar is recompiled as ``start: "<removed>" @inner`` (see
   `metaloom.constrain.grammar`): llguidance consumes the removed text first and then applies
   the grammar to the text after the original prompt; a token may straddle the boundary.

The completion's text and tokens are what was generated, so they *start with the removed
text* (``"://example.com"`` for the prompt above): ``prompt[:-len(removed)] + text`` is the
final text, and ``text[len(removed):]`` is what follows the original prompt (what a grammar
constrained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metaloom.constrain import CompiledGrammar, Constraint, ConstraintSpec, Vocabulary, compile_constraint
from metaloom.errors import InvalidParameter

MAX_BACKUP = 4  # tokens removed at most, only to reach a UTF-8 character boundary


@dataclass(frozen=True)
class Healed:
    """``ids``: the prompt to prefill; ``removed``: the text cut off its end (may be empty)."""

    ids: tuple[int, ...]
    removed: str


def heal_prompt(ids: Sequence[int], vocab: Vocabulary) -> Healed:
    """Back ``ids`` up over its last token (see the module docstring)."""
    ids = tuple(int(i) for i in ids)
    for k in range(1, min(MAX_BACKUP, len(ids) - 1) + 1):
        tail = ids[-k:]
        if any(vocab.is_special(t) for t in tail):
            break
        try:
            removed = vocab.tokens_bytes(list(tail)).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if removed:
            return Healed(ids[:-k], removed)
    return Healed(ids, "")


class HealingCursor:
    """A `Constraint` that only makes the output start with ``prefix`` (bytes)."""

    def __init__(self, vocab: Vocabulary, prefix: bytes, history: list[bytes] | None = None) -> None:
        self.vocab = vocab
        self.remaining = prefix
        self._history: list[bytes] = history if history is not None else []  # `remaining` before each advance

    @property
    def unconstrained(self) -> bool:
        return not self.remaining

    def mask(self) -> torch.Tensor:
        if not self.remaining:
            return self.vocab.free_mask().clone()
        return self.vocab.ids_mask(self.vocab.compatible(self.remaining))

    def advance(self, token: int) -> None:
        token = int(token)
        rest = self.remaining
        if rest:
            b = self.vocab.token_bytes(token)
            if b is not None and b.startswith(rest):
                rest = b""
            elif b and rest.startswith(b):
                rest = rest[len(b):]
            else:
                raise InvalidParameter("token", token, f"a token compatible with the healed text {self.remaining!r}")
        self._history.append(self.remaining)
        self.remaining = rest

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self._history):
            raise InvalidParameter("n", n, f"0..{len(self._history)} (tokens advanced so far)")
        if n:
            self.remaining = self._history[-n]
            del self._history[-n:]

    def fork(self) -> HealingCursor:
        return HealingCursor(self.vocab, self.remaining, list(self._history))

    def done(self) -> bool:
        return False


@dataclass(frozen=True)
class Prepared:
    """A request's prompt after healing and what each of its rows is constrained by."""

    ids: tuple[int, ...]
    removed: str
    vocab: Vocabulary
    compiled: CompiledGrammar | None

    def cursor(self) -> Constraint | None:
        """A fresh cursor for one output row (None: unconstrained)."""
        if self.compiled is not None:
            return self.compiled.cursor()
        if self.removed:
            return HealingCursor(self.vocab, self.removed.encode())
        return None


def prepare(ids: Sequence[int], spec: ConstraintSpec | None, token_healing: bool, vocab: Vocabulary) -> Prepared:
    """Heal the prompt (if asked) and compile the constraint (if any) — raising
    `InvalidGrammar` for a bad one — before any model call."""
    healed = heal_prompt(ids, vocab) if token_healing else Healed(tuple(ids), "")
    compiled = compile_constraint(spec, vocab, healed.removed) if spec is not None else None
    return Prepared(healed.ids, healed.removed, vocab, compiled)
