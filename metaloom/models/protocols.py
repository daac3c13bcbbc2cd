"""The seams between models and everything above them (DESIGN.md, "Core abstractions").

A `LanguageModel` appends to a `KVCache` and returns logits; scoring a continuation is a
forward over it. Decoders, the generator and speculative decoding see only these protocols,
so the native model, the transformers adapter and the toy models are interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """Keys/values of a batch of rows; row ``b`` holds ``lengths[b]`` tokens."""

    @property
    def lengths(self) -> torch.Tensor:  # [B] long
        ...

    @property
    def capacity(self) -> int: ...

    def fork(self, rows: Sequence[int]) -> KVCache:
        """A new cache whose row ``i`` is a copy of this cache's row ``rows[i]``."""
        ...

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Shorten each row to ``lengths[b]`` (<= its current length); used to roll back."""
        ...


@runtime_checkable
class LanguageModel(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (or [B, 1, V] with ``last_only``), appending the
        tokens to ``cache``.

        ``valid`` [B] (default all T): row ``b`` appends only its first ``valid[b]`` tokens
        (rows of a batch may be right-padded); with ``last_only`` the logits are those at
        each row's last valid position.
        """
        ...

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        """FLOPs of a forward over ``new_tokens`` tokens attending to ``attended`` key
        positions in total (summed over the new tokens) and producing ``logit_rows`` rows of
        logits. See `metaloom.models.flops`."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str: ...
