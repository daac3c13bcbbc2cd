"""Toy language models behind the real `LanguageModel` / `KVCache` protocols.

`MarkovModel`: next-token logits depend only on the previous token, through a [V, V] table
(row = previous token). Its cache stores token ids, so fork/truncate/mixed lengths behave
exactly like a real cache and engine tests run in milliseconds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from metaloom.errors import CacheFull, InvalidParameter


class TokenCache:
    """Stores the token ids of each row: [B, capacity] plus per-row lengths."""

    def __init__(self, batch: int, capacity: int) -> None:
        self.tokens = torch.zeros(batch, capacity, dtype=torch.long)
        self._lengths = torch.zeros(batch, dtype=torch.long)

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def append(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        for b in range(tokens.shape[0]):
            n, start = int(valid[b]), int(self._lengths[b])
            if start + n > self.capacity:
                raise CacheFull(f"toy cache needs {start + n} positions but has {self.capacity}")
            self.tokens[b, start:start + n] = tokens[b, :n]
        self._lengths = self._lengths + valid

    def fork(self, rows: Sequence[int]) -> TokenCache:
        new = TokenCache(len(rows), self.capacity)
        index = torch.as_tensor(list(rows), dtype=torch.long)
        new.tokens = self.tokens[index].clone()
        new._lengths = self._lengths[index].clone()
        return new

    def join(self, other: TokenCache) -> TokenCache:
        """This cache's rows, then ``other``'s (rows joining a running batch)."""
        new = TokenCache(self.tokens.shape[0] + other.tokens.shape[0], max(self.capacity, other.capacity))
        new.tokens[:self.tokens.shape[0], :self.capacity] = self.tokens
        new.tokens[self.tokens.shape[0]:, :other.capacity] = other.tokens
        new._lengths = torch.cat([self._lengths, other._lengths])
        return new

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        new = torch.as_tensor(lengths, dtype=torch.long)
        if new.shape != self._lengths.shape or bool((new < 0).any()) or bool((new > self._lengths).any()):
            raise InvalidParameter("lengths", new.tolist(), f"values in [0, {self._lengths.tolist()}]")
        self._lengths = new.clone()


class TokenCacheModel(ABC):
    """What the toy models share: a CPU `LanguageModel` over a `TokenCache`, costed as one
    vocabulary-sized matmul per logit row. Subclasses set ``_max_context`` and ``vocab_size``."""

    _max_context: int

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_cache(self, batch: int, capacity: int) -> TokenCache:
        return TokenCache(batch, capacity)

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        return float(2 * self.vocab_size * logit_rows)


class MarkovModel(TokenCacheModel):
    """logits[b, t] = table[tokens[b, t]]: a first-order Markov chain over a small vocabulary."""

    def __init__(self, table: torch.Tensor, max_context: int = 1024) -> None:
        if table.dim() != 2 or table.shape[0] != table.shape[1]:
            raise InvalidParameter("table", tuple(table.shape), "a square [V, V] logits table")
        self.table = table.float()
        self._max_context = max_context

    @classmethod
    def random(cls, vocab: int, seed: int = 0, sharpness: float = 3.0) -> MarkovModel:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(vocab, vocab, generator=g) * sharpness)

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    def forward(self, tokens: torch.Tensor, cache: TokenCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        b, t = tokens.shape
        if valid is None:
            valid = torch.full((b,), t, dtype=torch.long)
        cache.append(tokens, valid)
        logits = self.table[tokens]  # [B, T, V]
        if last_only:
            logits = logits[torch.arange(b), valid - 1][:, None]
        return logits


class CharTokenizer:
    """Token i is the character chr(ord('a') + i); `eos` (if given) decodes to nothing."""

    def __init__(self, vocab: int, eos: int | None = None) -> None:
        self.vocab = vocab
        self.eos = eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset() if self.eos is None else frozenset({self.eos})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids if i != self.eos)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)
