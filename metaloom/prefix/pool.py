"""The prefix cache: a `RadixTree` whose values are KV slots of the engine's `KVPool`.

Each tree edge holds the slot ids of its tokens' keys and values (`metaloom.models.engine.cache`): a
cached prefix is not a copy of KV but a set of references into the same pool the decoding rows
use. Loading a prefix into a new row copies slot ids (8 bytes a token) and takes a reference to
each slot; storing a row's tokens takes references to the row's slots. Neither copies a key or
a value, so storing generated tokens (a branch a search may continue from) costs nothing but
bookkeeping (SGLang's RadixAttention, Zheng et al. 2024).

Budget: ``budget_bytes`` bounds the KV the tree keeps alive on its own, counted as slots held
by the tree times the bytes of one slot. When a new entry needs room, unreferenced leaves go
first, least recently used first (the tree's order); if even that is not enough, only the part
that fits is stored. A slot that a decoding row also holds stays alive until the row lets go.
Reference counts on the tree (`match` locks, `release` unlocks) keep a prefix that a caller is
still reading from being evicted.

Not thread-safe by itself: one engine (one decode loop) per cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from metaloom.errors import InvalidParameter
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.pool import KVPool
from metaloom.prefix.radix import Match, RadixTree


def split_slots(slots: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut an edge's slot ids after ``k`` tokens (the references move with them)."""
    return slots[:k].copy(), slots[k:].copy()


@dataclass(frozen=True)
class PrefixHit:
    """A locked match: ``length`` tokens of the prompt are cached. Pass it to `PrefixCache.load`
    and, once done, to `PrefixCache.release`."""

    length: int
    match: Match[np.ndarray]


class PrefixCache:
    """Radix prefix cache across calls; create one and hand it to `LocalGenerator(...,
    prefix_cache=...)`. It serves one KV pool (one model) only: the first it is bound to."""

    def __init__(self, budget_bytes: int) -> None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 0:
            raise InvalidParameter("budget_bytes", budget_bytes, "a non-negative number of bytes")
        self.budget_bytes = budget_bytes
        self.tree: RadixTree[np.ndarray] = RadixTree(split_slots)
        self._pool: weakref.ref[KVPool] | None = None

    def bind(self, pool: KVPool) -> None:
        """Tie this cache to ``pool``: its entries are slots there, valid for that model only."""
        bound = self._pool() if self._pool is not None else None
        if bound is not None and bound is not pool:
            raise InvalidParameter("prefix_cache", type(self).__name__,
                                   "a prefix cache not already in use by another engine (create one per engine)")
        self._pool = weakref.ref(pool)

    @property
    def pool(self) -> KVPool:
        pool = self._pool() if self._pool is not None else None
        if pool is None:
            raise InvalidParameter("prefix_cache", type(self).__name__, "a cache bound to an engine's KV pool")
        return pool

    @property
    def bytes_per_token(self) -> int:
        pool = self._pool() if self._pool is not None else None
        return pool.bytes_per_slot if pool is not None else 0

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

    def load(self, hit: PrefixHit, cache: PagedKVCache, row: int) -> None:
        """Append the hit's ``length`` cached tokens to ``row`` of ``cache`` (normally empty)."""
        if cache.pool is not self.pool:
            raise InvalidParameter("cache", type(cache).__name__, "a cache in the prefix cache's KV pool")
        spans = [slots[:take] for slots, take in hit.match.spans() if take]
        if spans:
            cache.append_slots(row, np.concatenate(spans))

    def insert(self, tokens: Sequence[int], cache: PagedKVCache, row: int) -> int:
        """Store ``tokens``, whose KV are the first ``len(tokens)`` positions of ``row``; returns
        how many tokens were stored anew (fewer than missing when the budget is short)."""
        if cache.pool is not self.pool:
            raise InvalidParameter("cache", type(cache).__name__, "a cache in the prefix cache's KV pool")
        if cache.shift[row]:  # its entries are no longer positions 0.. (a --kv-policy dropped some)
            return 0
        if int(cache.lengths[row]) < len(tokens):
            raise InvalidParameter("tokens", len(tokens), f"at most the row's length {int(cache.lengths[row])}")
        hit = self.match(tokens)  # pin the present part, so making room never evicts it
        try:
            present = hit.length
            if present == len(tokens):
                return 0
            room = self._make_room(len(tokens) - present)
        finally:
            self.release(hit)
        if room <= 0:
            return 0
        slots = cache.row_slots(row, present, present + room)
        self.pool.retain(slots)
        return self.tree.insert(tokens[:present + room], slots, offset=present)

    def evict(self, tokens: int) -> int:
        """Drop up to ``tokens`` unreferenced cached tokens (least recently used first); returns
        how many were dropped. Their slots go back to the pool unless a row still holds them."""
        gone = self.tree.evict(tokens)
        for e in gone:
            self.pool.release(e.value)
        return sum(e.tokens for e in gone)

    def remap(self, mapping: np.ndarray) -> None:
        """Rename every slot the tree holds by ``mapping`` (old id -> new id: `KVPool.compact`)."""
        for node in self.tree.nodes():
            if node.value is not None:
                node.value = mapping[node.value]

    def clear(self) -> None:
        """Drop every unreferenced entry."""
        self.evict(self.tree.size)

    def _make_room(self, want: int) -> int:
        """Evict until ``want`` more tokens fit the budget (or nothing evictable is left);
        returns how many tokens fit now."""
        per = self.bytes_per_token
        capacity = self.budget_bytes // per if per else 0
        short = self.tree.size + want - capacity
        if short > 0:
            self.evict(short)
        return min(want, capacity - self.tree.size)
