"""Incremental detokenisation: the text of a growing token sequence at O(new tokens) per step.

Re-decoding a row's whole output on every step (``tokenizer.decode(tokens)``) costs O(n) per
token and O(n^2) per trace. `IncrementalDetokenizer` uses the "prefix offset / read offset"
method of Hugging Face TGI (``text_generation_server/models/model.py``, ``decode_token``) and
vLLM (``vllm/transformers_utils/detokenizer_utils.py``, ``detokenize_incrementally``): each
step decodes only a short window, the tokens from ``prefix`` on, and the new text is that
window's text minus the text of its first part (``prefix`` to ``read``), which was emitted
already. Decoding a few tokens before the new ones, rather than the new ones alone, keeps what
depends on the left neighbour exact (a SentencePiece token's leading space, bytes of one
character split over several byte-level tokens).

Why it is exact for a byte-level BPE (GPT-2, SmolLM2: the decoder concatenates the tokens'
bytes and decodes them with ``String::from_utf8_lossy``): lossy UTF-8 decoding is a streaming
decoder that buffers only the current incomplete character, so every character of a decoded
window is final except a trailing "\\ufffd", which more bytes may still turn into a real
character. `push` therefore emits everything but such a trailing "\\ufffd" at once, and moves
``read`` on only at a *clean* boundary, where the decoder buffers nothing; from a clean
boundary on, decoding from any earlier start gives the same text as decoding from the
beginning (a lone continuation byte decodes alone as "\\ufffd"; a lead or ASCII byte
resynchronises), so the window's text minus its first part is the true continuation.

Additions to the TGI/vLLM method, so that the window stays bounded in every case:

* The final part of a held window is emitted at once (TGI/vLLM emit nothing until the window
  no longer ends in "\\ufffd").
* After `CUT_AFTER` held tokens (invalid UTF-8 that never completes, e.g. a model emitting stray
  byte tokens), `read` moves to the latest token boundary ``c`` where
  ``decode(window[:c]) + decode(window[c:]) == decode(window)`` with a non-empty right part:
  the byte after ``c`` does not continue a buffered character, so ``c`` is clean for good. A
  character has at most 4 bytes, so for a byte-level BPE such a boundary is among the last 4
  tokens that carry bytes.
* Tokens that decode to nothing (special tokens, skipped by ``decode`` with
  ``skip_special_tokens=True``) are removed from the window when the window decodes the same
  without them, wherever they would otherwise pile up: held inside an incomplete character,
  at the end of the context, or as the only context before the next token (a word-joining or
  SentencePiece decoder would then lose the space before the next word).

The guarantee, with ``full = tokenizer.decode([*context, *tokens])`` and
``ctx = tokenizer.decode(context).removesuffix("\\ufffd")``::

    "".join(push(t) for t in tokens) + flush() == text == full[len(ctx):]

for tokenizers whose decode is *prefix-stable* (``decode(a)``, minus a trailing "\\ufffd", is a
prefix of ``decode(a + b)``), such as byte-level BPE (SmolLM2), `CharTokenizer` and
`WordTokenizer`. When ``decode(context)`` does not end in "\\ufffd" (the usual case) ``ctx`` is
all of it, and ``text == full[len(decode(context)):]``. Documented exceptions, each pinned by a
test in ``tests/test_detok.py``:

* A context that ends inside a character (its decode ends in "\\ufffd"): the character that the
  output's bytes complete (or the "\\ufffd" they settle) belongs to the output's text, hence
  ``ctx`` above.
* Decoders that are not prefix-stable (e.g. transformers' ``clean_up_tokenization_spaces``,
  which deletes a space, decoded already, before later punctuation): text already emitted is
  not taken back; the new text is the window's text after its common prefix with the emitted
  text, so nothing is lost but the deleted space stays (``"a ."`` where decode gives ``"a."``).
* A window that still ends in "\\ufffd" after more than `MAX_HELD` held tokens with no clean
  boundary and no silent token among them (impossible for a byte-level BPE, by the bound
  above; a decoder that always appends "\\ufffd"): the "\\ufffd" is emitted and decoding starts
  afresh after it, as if the two parts were decoded separately. The same holds after a
  `flush` that returned text (the end of the sequence, by contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the protocol module imports torch; this module must not
    from metaloom.models.protocols import Tokenizer

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decoder writes for an incomplete/invalid sequence
CONTEXT_TOKENS = 6  # tokens of `context` kept before the output (vLLM keeps 5 prompt tokens)
CONTEXT_SCAN = 4 * CONTEXT_TOKENS  # how far back `_context_window` looks past silent tokens
CUT_AFTER = 4  # held tokens after which `read` looks for a clean boundary among them
MAX_HELD = 16  # held tokens after which a trailing "\ufffd" is given up as final


class IncrementalDetokenizer:
    """Text of a growing token sequence at O(new tokens) per step (the 'prefix offset / read
    offset' method of TGI and vLLM; see the module docstring for the guarantee).

    State: ``_ids`` is the window (tokens from the prefix offset on); ``_ids[:_read]`` decodes
    to ``_prefix_text``, emitted already (or context); ``_held`` characters of the text after
    it were emitted too, while the window still ended in "\\ufffd".
    """

    __slots__ = ("_held", "_ids", "_pieces", "_prefix_text", "_read", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids = _context_window(tokenizer, context)
        self._read = len(self._ids)
        # a trailing "\ufffd" of the context is not final: the output's bytes may complete it
        self._prefix_text = tokenizer.decode(self._ids).removesuffix(REPLACEMENT) if self._ids else ""
        self._held = 0
        self._pieces: list[str] = []

    def push(self, token: int) -> str:
        """Append one token; return the text that became final with it (may be "")."""
        self._ids.append(token)
        window = self._tokenizer.decode(self._ids)
        new = window[_common_prefix(window, self._prefix_text):]  # prefix-stable: all of `_prefix_text`
        if not new.endswith(REPLACEMENT):
            out = self._emit(new)
            self._advance(len(self._ids))
            return out
        out = self._emit(new[:-1])  # all but the last character is final already
        held = len(self._ids) - self._read
        if held > CUT_AFTER and not self._cut(window) and not self._drop_silent(window) and held > MAX_HELD:
            out += self._emit(new)  # give the character up (see the module docstring)
            self._restart()
        return out

    @property
    def text(self) -> str:
        """All final text so far (excludes the context). The pieces are joined on demand, so a
        caller that needs the text every step should keep the pushes' results instead."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def flush(self) -> str:
        """At the end of the sequence: return what is still held back (a trailing incomplete
        character, as the tokenizer decodes it, i.e. "\\ufffd"). Pushing after a flush that
        returned text starts afresh."""
        window = self._tokenizer.decode(self._ids)
        out = self._emit(window[_common_prefix(window, self._prefix_text):])
        if out:
            self._restart()
        return out

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (beam search copies rows); O(window), the text is shared."""
        other = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        other._tokenizer = self._tokenizer
        other._ids = list(self._ids)
        other._read = self._read
        other._prefix_text = self._prefix_text
        other._held = self._held
        other._pieces = [self.text] if self._pieces else []
        return other

    def _emit(self, new: str) -> str:
        """Record the final text ``new`` (after `_prefix_text`); return its unseen part."""
        out = new[self._held:]
        if out:
            self._pieces.append(out)
            self._held = len(new)
        return out

    def _advance(self, read: int) -> bool:
        """Move the read offset to the clean boundary ``read`` and the prefix offset to the
        old read offset (TGI/vLLM).

        Tokens that decode to nothing (special tokens, which ``decode`` skips) must not become
        the whole context of the next window (a word-joining or SentencePiece decoder would
        then drop the space before the next word): they are removed from the window when the
        text before them decodes the same with them, else the prefix keeps the last
        `CONTEXT_TOKENS` tokens (one when there is no text before them: a SentencePiece
        decoder strips the space of the first token, so a silent token there may matter).
        Returns whether they were removed (then the offsets and `_held` stay as they were)."""
        start = self._read
        text = self._tokenizer.decode(self._ids[start:read])
        if not text and start < read:
            before = self._tokenizer.decode(self._ids[:start])
            if before and self._tokenizer.decode(self._ids[:read]) == before:
                del self._ids[start:read]
                return True
            start = max(0, read - (CONTEXT_TOKENS if before else 1))
            text = self._tokenizer.decode(self._ids[start:read])
        self._held = 0  # `_cut` sets what was emitted after `read`
        self._ids = self._ids[start:]
        self._read = read - start
        self._prefix_text = text
        return False

    def _cut(self, window: str) -> bool:
        """Move the read offset to the latest clean boundary inside the held tokens, if any
        (see the module docstring); return whether one was found."""
        for c in range(len(self._ids) - 1, self._read, -1):
            rest = self._tokenizer.decode(self._ids[c:])
            if rest and window.endswith(rest) and self._tokenizer.decode(self._ids[:c]) == window[:-len(rest)]:
                # the held text up to `c` was emitted by `_emit`; the rest of `_held` is after `c`
                held = self._held - (len(window) - len(rest) - len(self._prefix_text))
                if not self._advance(c):
                    self._held = held
                return True
        return False

    def _drop_silent(self, window: str) -> bool:
        """Remove the held tokens that decode to nothing (special tokens inside a multi-byte
        character: ``decode`` skips them) if the window decodes the same without them; return
        whether any were removed."""
        keep = self._ids[:self._read] + [t for t in self._ids[self._read:] if self._tokenizer.decode([t])]
        if len(keep) == len(self._ids) or self._tokenizer.decode(keep) != window:
            return False
        self._ids = keep
        return True

    def _restart(self) -> None:
        """Decode what follows afresh, without context (see the module docstring)."""
        self._ids, self._read, self._prefix_text, self._held = [], 0, "", 0


def _context_window(tokenizer: Tokenizer, context: Sequence[int]) -> list[int]:
    """The last `CONTEXT_TOKENS` tokens of ``context`` that decode to something, without the
    silent ones (special tokens) among them when that leaves their text unchanged: a context
    that ends in special tokens must still show the decoder the bytes before them (a character
    may continue across them, since ``decode`` skips them)."""
    span = list(context[-CONTEXT_SCAN:])
    kept: list[int] = []
    start = len(span)
    while start > 0 and len(kept) < CONTEXT_TOKENS:
        start -= 1
        if tokenizer.decode([span[start]]):
            kept.append(span[start])
    kept.reverse()
    if len(kept) < len(span) - start and tokenizer.decode(kept) != tokenizer.decode(span[start:]):
        return span[start:]
    return kept


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (``len(b)`` when ``a`` starts
    with ``b``, the prefix-stable case, checked first since it is the usual one)."""
    if a.startswith(b):
        return len(b)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
