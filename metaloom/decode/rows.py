"""Per-row decoding state: generated tokens, their log-probabilities, the detokenised text,
stop-string and end-of-sequence handling, and what streaming may already show."""

from __future__ import annotations

from dataclasses import dataclass, field

from metaloom.models.protocols import Tokenizer


@dataclass
class RowState:
    """Mutable state of one output row (one sample of one request)."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    emitted: int = 0  # characters of `text` already streamed

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, tokenizer: Tokenizer) -> None:
        """Record one generated token and decide whether the row is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return
        previous = len(self.text)
        self.text = tokenizer.decode(self.tokens)
        if self.stop:
            # a stop string can only end in the new text; search a window that covers it
            start = max(0, previous - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.finish_reason = "stop"
                return
        if len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"

    def pending_text(self) -> str:
        """New text that is safe to stream: holds back a trailing partial UTF-8 character and
        any suffix that could still grow into a stop string (it may be cut later)."""
        end = len(self.text)
        if not self.done:
            while end > self.emitted and self.text[end - 1] == "\ufffd":
                end -= 1
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text[end - k:end] == s[:k]:
                        end -= k
                        break
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
