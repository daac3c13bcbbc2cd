"""Radix prefix cache across calls (SGLang's RadixAttention, Zheng et al. 2024): a pure trie
over token ids (`radix`) and a pool binding it to KV blocks under a memory budget (`pool`).

    cache = PrefixCache(budget_bytes=2 << 30)
    gen = LocalGenerator(loaded, prefix_cache=cache)

`metaloom.prefix.bench.time_to_first_token` measures what it saves.
"""

from metaloom.prefix.pool import BlockKVCache, PrefixCache, PrefixHit
from metaloom.prefix.radix import Match, Node, RadixTree

__all__ = ["BlockKVCache", "Match", "Node", "PrefixCache", "PrefixHit", "RadixTree"]
