"""Per-row decoding state: generated tokens, their log-probabilities, the text (detokenised
incrementally: O(new tokens) a step), why the row stopped, and what streaming may show yet.

`RowState.append` is the one place a generated token lands, for every decoder (the decode
loop, speculative decoding, beam search); `emit` adds the row's constraint cursor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from metaloom.decode.detok import IncrementalDetokenizer
from metaloom.decode.specs import TopLogprobs
from metaloom.models.protocols import Tokenizer

if TYPE_CHECKING:
    from metaloom.constrain import Constraint


@dataclass
class RowState:
    """Mutable state of one output row (one sample of one request).

    ``text`` is the detokenised output so far (`metaloom.decode.detok`: a trailing incomplete
    character is held back until settled); ``finish_reason``/``stop_reason``/``error`` follow
    `metaloom.generator.types.Completion`."""

    max_tokens: int
    detok: IncrementalDetokenizer
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    include_stop: bool = False  # keep a matched stop string (and the rest of its token) in the text
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # decoder log-probabilities (`Completion.decoder_logprobs`)
    top_k: int = 0  # how many most-likely tokens to record per position (`SamplingParams.top_logprobs`)
    top: list[TopLogprobs] = field(default_factory=list)  # `Completion.top_logprobs`, when top_k > 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    emitted: int = 0  # characters of `text` already streamed
    sent: int = 0  # tokens already streamed
    closed: bool = False  # the final chunk (with the finish) was streamed

    @classmethod
    def start(cls, tokenizer: Tokenizer, max_tokens: int, *, stop: tuple[str, ...] = (),
              eos_ids: frozenset[int] = frozenset(), include_stop: bool = False, context: tuple[int, ...] = (),
              top_k: int = 0) -> RowState:
        """A fresh row; ``context``: the tokens its output continues (a prefix), so the first
        tokens' text is what it would be after them."""
        return cls(max_tokens=max_tokens, detok=IncrementalDetokenizer(tokenizer, context), stop=stop, eos_ids=eos_ids,
                   include_stop=include_stop, top_k=top_k)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, score: float | None = None, top: TopLogprobs | None = None) -> None:
        """Record one generated token (``top``: the position's most likely tokens, when the
        row records them) and decide whether the row is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if score is not None:
            self.scores.append(score)
        if top is not None:
            self.top.append(top)
        if token in self.eos_ids:
            self.finish("stop", token)
            return
        before = len(self.text)
        self.text += self.detok.push(token)
        if self.stop and len(self.text) > before:
            # a stop string can only end in the new text; search a window that covers it
            start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, matched = min(hits)
                if not self.include_stop:
                    self.text = self.text[:at]
                self.finish("stop", matched, settle=self.include_stop)
                return
        if len(self.tokens) >= self.max_tokens:
            self.finish("length")

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None, *,
               settle: bool = True) -> None:
        """End the row. ``settle``: add any text the detokeniser still holds (a trailing
        incomplete character), so ``text`` is everything the tokens decode to."""
        if self.done:
            return
        self.finish_reason, self.stop_reason, self.error = reason, stop_reason, error
        if settle:
            self.text += self.detok.flush()

    def fork(self) -> RowState:
        """An independent copy (beam search branches rows)."""
        return RowState(max_tokens=self.max_tokens, detok=self.detok.fork(), stop=self.stop, eos_ids=self.eos_ids,
                        include_stop=self.include_stop, tokens=list(self.tokens), logprobs=list(self.logprobs),
                        scores=list(self.scores), top_k=self.top_k, top=list(self.top), text=self.text,
                        finish_reason=self.finish_reason, stop_reason=self.stop_reason, error=self.error,
                        emitted=self.emitted, sent=self.sent)

    def pending_text(self) -> str:
        """New text that is safe to stream: holds back any suffix that could still grow into a
        stop string (it may be cut later); all of it once the row is done."""
        end = len(self.text)
        if not self.done:
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text[end - k:end] == s[:k]:
                        end -= k
                        break
        out = self.text[self.emitted:end]
        self.emitted = end
        return out


def emit(row: RowState, token: int, logprob: float, score: float | None, cursor: Constraint | None,
         top: TopLogprobs | None = None) -> None:
    """Append one token to a row and advance its constraint cursor; a cursor that is then
    complete ends the row ("stop", no stop reason: the constraint finished it)."""
    row.append(token, logprob, score, top)
    if cursor is not None:
        cursor.advance(token)
        if cursor.done() and not row.done:
            row.finish("stop")
