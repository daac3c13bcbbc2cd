"""`Vocabulary`: what constraint cursors need to know about one tokenizer and one model, built
once (about a second for a 50k-token BPE vocabulary) and shared by every grammar and row.

It holds llguidance's `LLTokenizer` (the token trie the engine walks to compute masks), the
byte string of every token (for token healing), and the model's vocabulary size: masks are
``[V]`` over the *model's* logits, which may be longer than the tokenizer's vocabulary
(padding rows of the embedding): those extra ids are never allowed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from metaloom.errors import InvalidParameter

INSTALL = "pip install llguidance"



def llguidance() -> Any:
    """The llguidance module, or a typed error that says how to install it."""
    try:
        import llguidance as llg
    except ImportError as exc:
        raise InvalidParameter("constraint", "llguidance", f"with llguidance installed: {INSTALL}") from exc
    return llg


def unpack_bits(packed: np.ndarray, n: int) -> np.ndarray:
    """packed [B, nbytes] uint8 bitmask -> [B, n] bool (``n <= 8 * nbytes``). llguidance puts
    token i at bit i % 32 of little-endian 32-bit word i // 32, i.e. bit i % 8 of byte i // 8."""
    return np.unpackbits(packed, axis=1, count=n, bitorder="little").view(np.bool_)


class _ProtocolTokenizerAdapter:
    """llguidance's `TokenizerWrapper` duck type for a tokenizer without a ``tokenizer.json``
    (the toy tokenizers of `metaloom.testing`): each token's bytes are its decoded text."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else size
        self.bos_token_id = None
        self.tokens = [b"" if i in eos else tokenizer.decode([i]).encode() for i in range(size)]
        self.special_token_ids = eos
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _tokenizer_json(tokenizer: Any) -> str | None:
    """The serialized HF `tokenizers` tokenizer behind ``tokenizer``, if it has one."""
    rust = getattr(tokenizer, "_tok", tokenizer)  # metaloom.models.engine.tokenizer.HFTokenizer keeps it there
    to_str = getattr(rust, "to_str", None)
    return to_str() if callable(to_str) else None


class Vocabulary:
    """One tokenizer seen by the grammar engine, with masks of length ``size`` (the model's
    vocabulary size). ``eos`` are the end-of-sequence ids a grammar allows when accepting."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        llg = llguidance()
        self.size = int(size)
        self.eos: tuple[int, ...] = tuple(sorted(tokenizer.eos_token_ids))
        serialized = _tokenizer_json(tokenizer)
        eos = list(self.eos) or None
        if serialized is not None:
            self.ll = llg.LLTokenizer(serialized, eos_token=eos)
        else:
            n = getattr(tokenizer, "vocab", None) or getattr(tokenizer, "vocab_size", None) or self.size
            self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_ProtocolTokenizerAdapter(tokenizer, int(n))), eos_token=eos)
        self.tokenizer_size: int = self.ll.vocab_size
        self._executor: Any = None
        self._index: tuple[list[bytes], list[int], dict[bytes, list[int]], list[bytes | None]] | None = None

    @property
    def executor(self) -> Any:
        """llguidance's thread pool for parallel batch masks (started on first use)."""
        if self._executor is None:
            self._executor = llguidance().LLExecutor()
        return self._executor

    # --- masks (numpy: on a busy few-core machine small parallel torch ops stall) -------------

    def from_bitmask(self, packed: np.ndarray) -> np.ndarray:
        """llguidance bitmasks [B, nbytes] uint8 -> allowed [B, size] bool (pads with False)."""
        n = min(self.tokenizer_size, self.size)
        bits = unpack_bits(packed, n)
        if n == self.size:
            return bits
        out = np.zeros((packed.shape[0], self.size), dtype=np.bool_)
        out[:, :n] = bits
        return out

    def free_mask(self) -> torch.Tensor:
        """Every token allowed, [size] bool."""
        return torch.from_numpy(np.ones(self.size, dtype=np.bool_))

    def ids_mask(self, ids: Sequence[int]) -> torch.Tensor:
        """Only ``ids`` allowed, [size] bool."""
        out = np.zeros(self.size, dtype=np.bool_)
        out[list(ids)] = True
        return torch.from_numpy(out)

    # --- token bytes (token healing) -------------------------------------------------------

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes ``token`` stands for; None for special tokens and ids past the tokenizer."""
        return self._healing_index()[3][token] if 0 <= token < self.size else None

    def tokens_bytes(self, tokens: Sequence[int]) -> bytes:
        return self.ll.decode_bytes(list(tokens))

    def is_special(self, token: int) -> bool:
        return not (0 <= token < self.tokenizer_size) or self.ll.is_special_token(token)

    def compatible(self, prefix: bytes) -> list[int]:
        """Ids of the (non-special) tokens whose bytes extend ``prefix`` or are a non-empty
        proper prefix of it: the tokens a text starting with ``prefix`` can start with.
        A sorted-bytes range for the first kind, one dictionary probe per length for the second."""
        ordered, ids, by_bytes, _ = self._healing_index()
        lo = bisect.bisect_left(ordered, prefix)
        hi = lo
        while hi < len(ordered) and ordered[hi].startswith(prefix):
            hi += 1
        out = ids[lo:hi]
        for k in range(1, len(prefix)):
            out = out + by_bytes.get(prefix[:k], [])
        return out

    def _healing_index(self) -> tuple[list[bytes], list[int], dict[bytes, list[int]], list[bytes | None]]:
        if self._index is None:
            per_id: list[bytes | None] = [None] * self.size
            by_bytes: dict[bytes, list[int]] = {}
            for i in range(min(self.tokenizer_size, self.size)):
                if self.ll.is_special_token(i):
                    continue
                b = self.ll.decode_bytes([i])
                if b:
                    per_id[i] = b
                    by_bytes.setdefault(b, []).append(i)
            pairs = sorted((b, i) for i, b in enumerate(per_id) if b is not None)
            self._index = ([b for b, _ in pairs], [i for _, i in pairs], by_bytes, per_id)
        return self._index

