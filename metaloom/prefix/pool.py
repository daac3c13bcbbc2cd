"""The prefix cache: a `RadixTree` whose values are KV blocks, under a memory budget.

A block is a copy of one tree edge's keys and values for every layer, a tensor
[layers, 2, H_kv, n, D] on the model's device. Reading a prefix copies its blocks into a row of
a fresh `StaticKVCache` (`BlockKVCache.append_block`); storing one copies a row's span out
(`read_block`). Copying rather than sharing pages (SGLang shares them through a paged KV pool)
keeps the native cache a plain dense tensor, so the path without a prefix cache is untouched;
the copy costs one memory pass over the prefix, far less than recomputing it.

Budget: ``budget_bytes`` bounds the bytes held in blocks after every insert. When a new prompt
needs room, unreferenced leaves go first, least recently used first (the tree's order); if even
that is not enough, only the part of the prompt that fits is stored. Reference counts (`match`
locks, `release` unlocks) keep a prefix that a caller is still reading from being evicted.

Not thread-safe: one generator (or one caller at a time) per cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from metaloom.errors import InvalidParameter
from metaloom.prefix.radix import Match, RadixTree


@runtime_checkable
class BlockKVCache(Protocol):
    """What the prefix cache needs of a KV cache, beyond `KVCache`: copy a row's span out and
    append a copied span to a row (`metaloom.models.cache.StaticKVCache` has both)."""

    @property
    def lengths(self) -> torch.Tensor: ...

    def read_block(self, row: int, start: int, end: int) -> torch.Tensor: ...

    def append_block(self, row: int, block: torch.Tensor) -> None: ...


def split_block(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a block [L, 2, H, n, D] after ``k`` tokens. Clones, so that evicting one half frees
    its memory (a view would keep the whole original storage alive)."""
    return block[:, :, :, :k].clone(), block[:, :, :, k:].clone()


@dataclass(frozen=True)
class PrefixHit:
    """A locked match: ``length`` tokens of the prompt are cached. Pass it to `PrefixCache.load`
    and, once done, to `PrefixCache.release`."""

    length: int
    match: Match[torch.Tensor]


class PrefixCache:
    """Radix prefix cache across calls; create one and hand it to `LocalGenerator(...,
    prefix_cache=...)`. It serves one model only (the first it is bound to)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise InvalidParameter("budget_bytes", budget_bytes, "a non-negative number of bytes")
        self.budget_bytes = budget_bytes
        self.tree: RadixTree[torch.Tensor] = RadixTree(split_block)
        self.bytes_per_token = 0  # known after the first insert
        self._model: weakref.ref[object] | None = None

    def bind(self, model: object) -> None:
        """Tie this cache to ``model``: KV entries are only valid for the weights that made them."""
        bound = self._model() if self._model is not None else None
        if bound is not None and bound is not model:
            raise InvalidParameter("prefix_cache", type(self).__name__,
                                   "a prefix cache not already in use by another model (create one per model)")
        self._model = weakref.ref(model)

    @property
    def cached_tokens(self) -> int:
        return self.tree.size

    @property
    def used_bytes(self) -> int:
        return self.tree.size * self.bytes_per_token

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of ``tokens``, locked until `release`."""
        m = self.tree.match(tokens)
        self.tree.lock(m)
        return PrefixHit(m.length, m)

    def release(self, hit: PrefixHit) -> None:
        self.tree.unlock(hit.match)

    def load(self, hit: PrefixHit, cache: BlockKVCache, row: int) -> None:
        """Append the hit's ``length`` cached tokens to ``row`` of ``cache`` (normally empty)."""
        for block, take in hit.match.spans():
            if take:
                cache.append_block(row, block if take == block.shape[3] else block[:, :, :, :take])

    def insert(self, tokens: Sequence[int], cache: BlockKVCache, row: int) -> int:
        """Store ``tokens``, whose KV are the first ``len(tokens)`` positions of ``row``; returns
        how many tokens were stored anew (fewer than missing when the budget is short)."""
        if int(cache.lengths[row]) < len(tokens):
            raise InvalidParameter("tokens", len(tokens), f"at most the row's length {int(cache.lengths[row])}")
        hit = self.match(tokens)  # pin the present part, so making room never evicts it
        try:
            present = hit.length
            if present == len(tokens):
                return 0
            block = cache.read_block(row, present, len(tokens))
            if not self.bytes_per_token:
                self.bytes_per_token = block.numel() * block.element_size() // block.shape[3]
            room = self._make_room(len(tokens) - present)
        finally:
            self.release(hit)
        if room <= 0:
            return 0
        if room < block.shape[3]:
            block = block[:, :, :, :room].clone()
        return self.tree.insert(tokens[:present + room], block, offset=present)

    def _make_room(self, want: int) -> int:
        """Evict until ``want`` more tokens fit the budget (or nothing evictable is left);
        returns how many tokens fit now."""
        capacity = self.budget_bytes // self.bytes_per_token
        short = self.tree.size + want - capacity
        if short > 0:
            self.tree.evict(short)
        return min(want, capacity - self.tree.size)
