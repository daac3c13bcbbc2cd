"""Prefill: run prompts into a fresh cache and return each prompt's next-token logits.

`prefill` runs prompts of different lengths in one right-padded forward. `prefill_cached` goes
through a radix prefix cache: each row starts from its prompt's longest cached prefix (slot ids
handed over, no KV copied) and computes only the rest; then every prompt is stored for later
calls. `prefill_pair` prefills the two streams of contrastive decoding / guidance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from metaloom.decode.contrastive import LockstepPair, PairCache
from metaloom.errors import UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.pool import KVPool
from metaloom.models.forward import Ledgers, charged_forward
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.prefix.pool import PrefixCache


def new_cache(model: LanguageModel, batch: int, capacity: int, pool: KVPool | None = None) -> KVCache:
    """``model.new_cache``, in ``pool`` when given (the native model's shared KV memory)."""
    if pool is None:
        return model.new_cache(batch, capacity)
    return model.new_cache(batch, capacity, pool=pool)  # type: ignore[call-arg]


def release_cache(cache: object) -> None:
    """Hand a cache's KV slots back to its pool now (the native paged cache; others have nothing
    to release, and the garbage collector would free the slots later anyway)."""
    release = getattr(cache, "release", None)
    if release is not None:
        release()


def _padded(model: LanguageModel, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens [B, longest] and each row's length [B]."""
    longest = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), longest, dtype=torch.long, device=model.device)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return tokens, torch.tensor([len(r) for r in rows], dtype=torch.long, device=model.device)


def prefill(model: LanguageModel, prompts: Sequence[Sequence[int]], capacity: int, ledger: Ledgers, *,
            pool: KVPool | None = None) -> tuple[KVCache, torch.Tensor]:
    """Run the prompts into a fresh cache. Returns (cache, logits [B, V] at each prompt's last token)."""
    tokens, valid = _padded(model, prompts)
    cache = new_cache(model, len(prompts), capacity, pool)
    logits = charged_forward(model, tokens, cache, ledger, valid=valid, last_only=True)
    return cache, logits[:, -1]


def prefill_cached(model: LanguageModel, prompts: Sequence[Sequence[int]], capacity: int, ledger: Ledgers,
                   prefix_cache: PrefixCache, *, pool: KVPool) -> tuple[KVCache, torch.Tensor]:
    """`prefill` through a radix prefix cache: each row starts from its prompt's longest cached
    prefix and computes only the rest; then every prompt is stored for later calls.

    The last prompt token is always computed, since its logits are needed. Rows start at
    different lengths, so the tails are right-padded (``valid``) and the cache is made large
    enough for the longest start plus the longest tail. Charges ``cached_tokens``; FLOPs are
    charged by `charged_forward` for the computed tokens only.
    """
    hits = [prefix_cache.match(p[:-1]) for p in prompts]
    try:
        cached = [h.length for h in hits]
        # padding positions run to max(start) + max(tail): keep them inside the context window
        while max(cached) + max(len(p) - c for p, c in zip(prompts, cached, strict=True)) > model.max_context:
            worst = max(range(len(prompts)), key=lambda i: cached[i])
            prefix_cache.release(hits[worst])
            hits[worst], cached[worst] = prefix_cache.match(()), 0
        tails = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        longest = max(len(t) for t in tails)
        cache = new_cache(model, len(prompts), max(capacity, max(cached) + longest), pool)
        if not isinstance(cache, PagedKVCache):
            raise UnsupportedModel(f"{type(cache).__name__} keeps no KV slots; the prefix cache needs the native model")
        for row, hit in enumerate(hits):
            prefix_cache.load(hit, cache, row)
        tokens, valid = _padded(model, tails)
        rows = ledger if isinstance(ledger, Ledger) else list(ledger)
        if isinstance(rows, Ledger):
            rows.charge(cached_tokens=sum(cached))
        else:
            for owner, c in zip(rows, cached, strict=True):
                if c:
                    _quiet(owner, cached_tokens=c)
        logits = charged_forward(model, tokens, cache, ledger, valid=valid, last_only=True)
        for row, p in enumerate(prompts):
            prefix_cache.insert(p, cache, row)
    finally:
        for h in hits:
            prefix_cache.release(h)
    return cache, logits[:, -1]


def _quiet(ledger: Ledger, **amounts: Any) -> None:
    """Charge without raising: the decode loop checks per-row ledgers itself."""
    from metaloom.errors import BudgetExceeded

    with contextlib.suppress(BudgetExceeded):
        ledger.charge(**amounts)


def prefill_pair(pair: LockstepPair, prompts: Sequence[Sequence[int]], secondary_prompts: Sequence[Sequence[int]],
                 capacities: tuple[int, int], params: torch.Tensor, ledger: Ledgers,
                 pools: tuple[KVPool | None, KVPool | None] = (None, None)) -> tuple[PairCache, torch.Tensor, torch.Tensor]:
    """Prefill both streams of ``pair`` (each its own prompts, cache capacity and KV pool);
    ``params`` [B, k] are the rows' combine parameters. Returns (cache, primary logits [B, V],
    combined scores [B, V])."""
    first_cache, first = prefill(pair.primary, prompts, capacities[0], ledger, pool=pools[0])
    second_cache, second = prefill(pair.secondary, secondary_prompts, capacities[1], ledger, pool=pools[1])
    return PairCache(first_cache, second_cache, params), first, pair.combine(first, second, params)


