"""Context-table toy models: the next-token distribution depends on the whole prefix.

`TableModel` looks up each position's prefix in a table of hand-written distributions (the
longest suffix of the prefix that the table knows wins; an unknown prefix ends the text), so
tests can state search problems exactly — e.g. the "I have a/an" example of greedy decoding's
myopia (`i_have_a_an`). It implements the real `LanguageModel` protocol over `TokenCache`, so
fork, truncate and mixed-length batches behave like a real cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from metaloom.errors import InvalidParameter
from metaloom.testing.toy_models import TokenCache, TokenCacheModel

EOS = "<eos>"


class WordTokenizer:
    """One token per word of ``words`` (space-separated text); ``<eos>`` decodes to nothing."""

    def __init__(self, words: Sequence[str]) -> None:
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self.index[EOS]}) if EOS in self.index else frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return [self.index[w] for w in text.split()]
        except KeyError as exc:
            raise InvalidParameter("text", text, f"words from {self.words}") from exc

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids if self.words[i] != EOS)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return " ".join(m["content"] for m in messages)


class TableModel(TokenCacheModel):
    """logits[b, t] = log P(. | tokens of row b up to and including position t).

    ``table`` maps a prefix (tuple of words) to {next word: probability}; missing words get
    probability 0 (logit -inf). A prefix is matched by its longest suffix in the table; when no
    suffix matches, the next token is ``<eos>`` with certainty.
    """

    def __init__(self, words: Sequence[str], table: Mapping[tuple[str, ...], Mapping[str, float]],
                 max_context: int = 256) -> None:
        self.tokenizer = WordTokenizer(words)
        if EOS not in self.tokenizer.index:
            raise InvalidParameter("words", list(words), f"a vocabulary that contains {EOS!r}")
        vocab = len(self.tokenizer.words)
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        for prefix, dist in table.items():
            row = torch.full((vocab,), float("-inf"))
            for word, p in dist.items():
                if p < 0:
                    raise InvalidParameter(f"table[{prefix}][{word}]", p, "a probability >= 0")
                row[self.tokenizer.index[word]] = math.log(p) if p > 0 else float("-inf")
            self._rows[tuple(self.tokenizer.index[w] for w in prefix)] = row
        self._end = torch.full((vocab,), float("-inf"))
        self._end[self.tokenizer.index[EOS]] = 0.0
        self._max_context = max_context
        self.calls = 0  # forwards run, for tests that count passes

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer.words)

    def _lookup(self, prefix: tuple[int, ...]) -> torch.Tensor:
        for start in range(len(prefix) + 1):
            row = self._rows.get(prefix[start:])
            if row is not None:
                return row
        return self._end

    def forward(self, tokens: torch.Tensor, cache: TokenCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        b, t = tokens.shape
        if valid is None:
            valid = torch.full((b,), t, dtype=torch.long)
        starts = cache.lengths.tolist()
        cache.append(tokens, valid)
        self.calls += 1
        logits = self._end.expand(b, t, self.vocab_size).clone()
        for row in range(b):
            history = cache.tokens[row, :starts[row] + int(valid[row])].tolist()
            for pos in range(int(valid[row])):
                logits[row, pos] = self._lookup(tuple(history[:starts[row] + pos + 1]))
        if last_only:
            logits = logits[torch.arange(b), valid - 1][:, None]
        return logits


def i_have_a_an() -> TableModel:
    """The example "Myopic" of the lecture "Decoding & Test-time Scaling" (EECE695D
    Efficient ML Systems, 2025): after "I have",
    P(a) = 0.7 and P(an) = 0.3; after "a" three fruits are equally likely, after "an" "apple"
    is certain; then the text ends. Greedy takes "a" (best sequence 0.7/3 ≈ 0.233) and misses
    "an apple" (0.3)."""
    words = ["I", "have", "a", "an", "apple", "pear", "cherry", "banana", EOS]
    third = 1.0 / 3.0
    table = {
        ("I", "have"): {"a": 0.7, "an": 0.3},
        ("I", "have", "a"): {"pear": third, "cherry": third, "banana": third},
        ("I", "have", "an"): {"apple": 1.0},
    }
    return TableModel(words, table)
