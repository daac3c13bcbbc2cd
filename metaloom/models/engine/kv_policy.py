"""Which positions a row keeps when its KV cache is held to a budget (``--kv-policy``,
``--kv-budget``): the pure choice of a kept set, given a row's length and the attention its
positions received. `metaloom.models.engine.dropping` applies the choice to a cache.

- ``full``: every position (no budget).
- ``streaming`` — StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with
  Attention Sinks"): the first `SINKS` positions (the attention sinks) and the most recent
  ``budget - SINKS``. As the paper does, positions count inside the cache: a query attends the
  sinks as if the dropped positions never were (the kernels rotate it at its in-cache position
  for the sinks; for the recent window the original positions give the same distances).
- ``h2o`` — Heavy-Hitter Oracle (Zhang et al. 2023, "H2O"): half the budget for the most
  recent positions, half for the older positions with the largest attention accumulated over
  every query so far (the prompt's included). Original positions are kept.
- ``snapkv`` — SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
  Generation"): a prompt longer than the budget keeps its last `SNAP_WINDOW` positions (the
  observation window) and the ``budget - SNAP_WINDOW`` older positions that window's queries
  attend to most, after average pooling of width `SNAP_KERNEL` (the authors' code's defaults).
  Only the prompt is compressed, as in the paper: generated tokens are appended after it.

One departure from H2O's and SnapKV's papers, forced by the pool (a slot holds a token's keys
and values for every layer and head, `metaloom.models.engine.cache`): a position is kept or
dropped for all heads and layers at once, scored by its attention summed over them, where the
papers choose per head.
"""

from __future__ import annotations

import numpy as np

from metaloom.errors import InvalidParameter

POLICIES = ("full", "streaming", "h2o", "snapkv")
SINKS = 4  # StreamingLLM's attention sinks: the paper finds four initial tokens enough
SNAP_WINDOW = 32  # SnapKV's observation window (queries at the end of the prompt)
SNAP_KERNEL = 5  # SnapKV's pooling width (average pooling, stride 1, same length)


def min_budget(policy: str) -> int:
    """The smallest budget ``policy`` can keep to: the sinks plus one token (streaming), one
    heavy and one recent token (h2o), the observation window plus one token (snapkv)."""
    return {"streaming": SINKS + 1, "h2o": 2, "snapkv": SNAP_WINDOW + 1}.get(policy, 0)


def check_policy(policy: str, budget: int | None) -> None:
    """`InvalidParameter` naming ``kv_policy`` or ``kv_budget`` when the pair is not one to run."""
    if policy not in POLICIES:
        raise InvalidParameter("kv_policy", policy, f"one of {list(POLICIES)}")
    if policy == "full":
        if budget is not None:
            raise InvalidParameter("kv_budget", budget, "unset with kv_policy 'full' (it keeps every position)")
        return
    if budget is None or isinstance(budget, bool) or not isinstance(budget, int):
        raise InvalidParameter("kv_budget", budget, f"a whole number of tokens with kv_policy {policy!r}")
    if budget < min_budget(policy):
        what = {"streaming": f"the {SINKS} attention sinks plus one token", "h2o": "one heavy and one recent token",
                "snapkv": f"the {SNAP_WINDOW}-token observation window plus one token"}[policy]
        raise InvalidParameter("kv_budget", budget, f">= {min_budget(policy)} with kv_policy {policy!r} ({what})")


def streaming_keep(n: int, keep: int, sinks: int = SINKS) -> np.ndarray:
    """The entries a StreamingLLM row of ``n`` entries keeps to hold ``keep``: the first
    ``sinks`` and the last ``keep - sinks`` (all of them when ``n <= keep``)."""
    if n <= keep:
        return np.arange(n, dtype=np.int64)
    return np.concatenate([np.arange(sinks), np.arange(n - (keep - sinks), n)]).astype(np.int64)


def h2o_keep(mass: np.ndarray, keep: int) -> np.ndarray:
    """The entries an H2O row keeps to hold ``keep``, given ``mass`` [n], the attention each
    entry has accumulated: the ``keep // 2`` most recent, and the ``keep - keep // 2`` older
    ones with the most mass (ties to the older entry). Ascending."""
    n = len(mass)
    if n <= keep:
        return np.arange(n, dtype=np.int64)
    recent = keep // 2
    older = n - recent
    heavy = np.argsort(-np.asarray(mass[:older], dtype=np.float64), kind="stable")[:keep - recent]
    return np.concatenate([np.sort(heavy), np.arange(older, n)]).astype(np.int64)


def snapkv_keep(votes: np.ndarray, keep: int, window: int = SNAP_WINDOW, kernel: int = SNAP_KERNEL) -> np.ndarray:
    """The entries a SnapKV prompt of ``len(votes) + window`` entries keeps to hold ``keep``:
    the ``window`` last, and the ``keep - window`` earlier ones whose pooled votes are largest.
    ``votes`` [n - window]: the attention the window's queries gave each earlier entry. The
    pooling is an average over ``kernel`` neighbours with zeros past the ends (what
    ``avg_pool1d(padding=kernel // 2)`` computes in SnapKV's code). Ascending."""
    earlier = len(votes)
    n = earlier + window
    if n <= keep:
        return np.arange(n, dtype=np.int64)
    half = kernel // 2
    padded = np.concatenate([np.zeros(half), np.asarray(votes, dtype=np.float64), np.zeros(half)])
    sums = np.concatenate([[0.0], np.cumsum(padded)])
    pooled = (sums[kernel:kernel + earlier] - sums[:earlier]) / kernel  # window of `kernel` centred on each entry
    chosen = np.argsort(-pooled, kind="stable")[:keep - window]
    return np.concatenate([np.sort(chosen), np.arange(earlier, n)]).astype(np.int64)
