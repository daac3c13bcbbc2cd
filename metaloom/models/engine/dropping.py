"""Holding each row of a KV cache to ``--kv-budget`` positions under ``--kv-policy``: when to
evict, what attention to record for the choice, and the attention of rows that dropped
positions on the PyTorch path. The choice itself is `metaloom.models.engine.kv_policy`'s.

When, per forward of `LlamaModel` over a `PagedKVCache`:

- before it (`before_forward`), ``streaming`` and ``h2o`` shrink every row that would pass the
  budget once this forward's tokens are added (a decode step drops one entry a row, as the
  papers' caches do);
- after it (`after_forward`), a row still past the budget (a prompt longer than the budget,
  attended in full by its own forward) is cut to the budget; ``snapkv`` does this only for
  a row's first multi-token forward past the budget (its prompt) and leaves decoding alone.

H2O's accumulated attention (`PagedKVCache.mass`) gets every query's attention probabilities,
summed over heads and layers: from the fused kernels (their ``probs`` output) on a decode step,
from `attend` on the PyTorch path. SnapKV's votes are the last `SNAP_WINDOW` valid queries'
probabilities in the prompt's forward, summed the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.kv_policy import SINKS, SNAP_WINDOW, h2o_keep, min_budget, snapkv_keep, streaming_keep
from metaloom.models.engine.options import EngineOptions

QUERY_BLOCK = 256  # queries scored at once by `attend`: bounds its [B, H, block, L] scores


def before_forward(options: EngineOptions, cache: PagedKVCache, valid: np.ndarray) -> None:
    """Evict, for ``streaming`` and ``h2o``, so that each row holds at most the budget after
    adding its ``valid`` new tokens (never below the policy's minimum; `after_forward` finishes
    a forward wider than the budget)."""
    if options.kv_policy not in ("streaming", "h2o") or options.kv_budget is None:
        return
    budget = options.kv_budget
    n = cache.host_lengths()
    for b in np.flatnonzero((n + valid > budget) & (n > 0)).tolist():
        _shrink(options.kv_policy, cache, b, max(budget - int(valid[b]), min_budget(options.kv_policy) - 1, 1))


def after_forward(options: EngineOptions, cache: PagedKVCache, width: int, votes: np.ndarray | None) -> None:
    """Cut every row still past the budget after a forward of ``width`` tokens a row: ``votes``
    [B, L] are SnapKV's (None otherwise)."""
    budget = options.kv_budget
    if budget is None:
        return
    n = cache.host_lengths()
    for b in np.flatnonzero(n > budget).tolist():
        if options.kv_policy == "snapkv":
            if width == 1 or cache.shift[b] or votes is None:
                continue  # decoding, or a prompt compressed already: SnapKV leaves them be
            nb = int(n[b])
            cache.evict(b, snapkv_keep(votes[b, :nb - SNAP_WINDOW], budget))
        else:
            _shrink(options.kv_policy, cache, b, budget)


def _shrink(policy: str, cache: PagedKVCache, row: int, keep: int) -> None:
    n = int(cache.host_lengths()[row])
    if n <= keep:
        return
    if policy == "streaming":
        cache.evict(row, streaming_keep(n, keep), sinks=SINKS)
    else:
        cache.evict(row, h2o_keep(cache.attention_mass()[row, :n], keep))


def needs_mass(options: EngineOptions, width: int) -> str | None:
    """What attention a forward of ``width`` tokens a row must record: ``"all"`` (H2O: every
    query's), ``"window"`` (SnapKV's prompt: its last queries'), or None."""
    if options.kv_policy == "h2o":
        return "all"
    if options.kv_policy == "snapkv" and width > 1:
        return "window"
    return None


def attend(q: torch.Tensor, q_in_cache: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
           entries: torch.Tensor, sinks: torch.Tensor, valid: torch.Tensor, mass: str | None,
           into: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of rows that may have dropped positions, explicitly (PyTorch path).

    q [B, H, T, D] rotated at the new tokens' positions; ``q_in_cache`` the same queries rotated
    at their entries (their in-cache positions; None when no row has sinks); keys, values [B,
    H_kv, L, D]; entries [B, T]: each query's entry (it sees entries 0..that one); sinks [B]:
    leading entries scored with ``q_in_cache``; valid [B]: the row's real queries (the rest is
    padding). With ``mass``, adds to ``into`` [B, L] the attention probabilities summed over
    heads and over the queries it names (`needs_mass`). -> [B, H, T, D]."""
    _, h, t, d = q.shape
    group = h // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    length = keys.shape[2]
    k_pos = torch.arange(length, device=q.device)
    sink_cols = k_pos[None, :] < sinks[:, None]  # [B, L]
    out = torch.empty_like(q)
    for at in range(0, t, QUERY_BLOCK):
        qs = slice(at, min(t, at + QUERY_BLOCK))
        scores = q[:, :, qs] @ keys.transpose(-1, -2)  # [B, H, block, L]
        if q_in_cache is not None:
            in_cache = q_in_cache[:, :, qs] @ keys.transpose(-1, -2)
            scores = torch.where(sink_cols[:, None, None], in_cache, scores)
        scores = scores * d ** -0.5
        allowed = k_pos[None, None, :] <= entries[:, qs, None]  # [B, block, L]
        probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        out[:, :, qs] = probs @ values
        if mass is not None and into is not None:
            query = torch.arange(qs.start, qs.stop, device=q.device)[None, :]  # [1, block]
            counted = query < valid[:, None]
            if mass == "window":
                counted &= query >= (valid[:, None] - SNAP_WINDOW)
            into += (probs.sum(1) * counted[:, :, None]).sum(1).to(into.dtype)
    return out
