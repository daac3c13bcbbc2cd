"""Radix prefix cache across calls (SGLang's RadixAttention, Zheng et al. 2024): a pure trie
over token ids (`radix`) whose values are KV slots of the engine's pool (`pool`).

    cache = PrefixCache(budget_bytes=2 << 30)
    gen = LocalGenerator(loaded, prefix_cache=cache)

`metaloom.bench.prefix.time_to_first_token` measures what it saves.
"""

from metaloom.prefix.pool import PrefixCache, PrefixHit
from metaloom.prefix.radix import Match, Node, RadixTree

__all__ = ["Match", "Node", "PrefixCache", "PrefixHit", "RadixTree"]
