"""What the prefix cache saves: time to the first token of a call whose prompt shares a long
prefix (a few-shot block, a document) with an earlier call. For `metaloom bench`; not a test.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.prefix.pool import PrefixCache
from metaloom.sampling import SamplingParams


def shared_prefix_text(loaded: LoadedModel, prefix_tokens: int) -> str:
    """Deterministic prose that encodes to about ``prefix_tokens`` tokens (cut at a token
    boundary and decoded back, so re-encoding may differ by a token or two)."""
    lines: list[str] = []
    ids: list[int] = []
    i = 0
    while len(ids) < prefix_tokens:
        i += 1
        lines.append(f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern rocks "
                     f"before dawn on day {i}, and each one carried a different flag.")
        ids = loaded.tokenizer.encode("\n".join(lines), add_special_tokens=False)
    return loaded.tokenizer.decode(ids[:prefix_tokens])


def time_to_first_token(loaded: LoadedModel, prefix_tokens: int = 1000, *, repeats: int = 5,
                        budget_bytes: int = 1 << 30) -> dict[str, Any]:
    """Median seconds to the first token of a prompt = shared prefix + a new question, without
    and with a prefix cache that an earlier call sharing the prefix has filled.

    Each timed call asks a different question, so only the shared prefix (and any tokens the
    questions share) can come from the cache. One warm-up call per side, untimed; the cached
    side's warm-up is the earlier call that stores the prefix. Returns the medians, their
    ratio, and the median tokens cached, prompt tokens and FLOPs per cached/uncached call.
    """
    if repeats < 1:
        raise InvalidParameter("repeats", repeats, "at least 1")
    prefix = shared_prefix_text(loaded, prefix_tokens)
    plain = LocalGenerator(loaded)
    cached = LocalGenerator(loaded, prefix_cache=PrefixCache(budget_bytes))

    def request(i: int) -> Request:
        question = f"\nQuestion {i}: how many ships did the keeper count on day {3 * i + 1}?\nAnswer:"
        return Request(prefix + question, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))

    def timed(gen: LocalGenerator, i: int) -> tuple[float, Ledger]:
        ledger = Ledger()
        start = time.perf_counter()
        gen.generate([request(i)], ledger=ledger)
        return time.perf_counter() - start, ledger

    timed(plain, 0)
    timed(cached, 0)
    rows: dict[str, list[float]] = {k: [] for k in ("uncached_s", "cached_s", "cached_tokens", "prompt_tokens",
                                                     "uncached_flops", "cached_flops")}
    for i in range(1, repeats + 1):  # interleaved, so drifting machine load hits both sides alike
        t_plain, l_plain = timed(plain, i)
        t_cached, l_cached = timed(cached, i)
        rows["uncached_s"].append(t_plain)
        rows["cached_s"].append(t_cached)
        rows["cached_tokens"].append(l_cached.usage.cached_tokens)
        rows["prompt_tokens"].append(l_cached.usage.input_tokens)
        rows["uncached_flops"].append(l_plain.usage.flops)
        rows["cached_flops"].append(l_cached.usage.flops)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rows.items()}
    out["prefix_tokens"] = prefix_tokens
    out["repeats"] = repeats
    out["speedup"] = out["uncached_s"] / out["cached_s"]
    return out
