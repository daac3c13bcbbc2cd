"""What one more prefill forward costs, in prompt tokens, on this model and this machine.

`metaloom.decode.joining.prefill_groups` splits prompts of mixed lengths into forwards; it weighs
the padding a shared forward wastes against the fixed cost of another forward (reading every
weight once, launching every layer). That fixed cost depends on the model and on the machine: a
memory-bound CPU with few cores pays ~50 tokens' worth per forward for a 135M model, a GPU
thousands. So it is measured, not assumed: with a forward of ``n`` tokens taking ``a + b·n``
seconds, the overhead is ``a / b`` tokens, from two timed forwards (1 and `PROBE_TOKENS` tokens).

The measurement is rounded to a power of two so that timing noise rarely moves the grouping
from one engine to the next; an engine given ``prefill_overhead_tokens`` uses that instead
(`metaloom.generator.LocalGenerator`), for a grouping fixed across machines.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from metaloom.decode.prefill import new_cache, release_cache
from metaloom.models.engine.pool import KVPool
from metaloom.models.protocols import LanguageModel

PROBE_TOKENS = 64  # long enough that the per-token cost dominates the difference of the two forwards
REPEATS = 3
MIN_TOKENS, MAX_TOKENS = 1, 1 << 16


def overhead_tokens(one_token_s: float, probe_s: float, probe_tokens: int = PROBE_TOKENS) -> int:
    """The fixed cost of a forward in token-equivalents, from a 1-token forward and a
    ``probe_tokens``-token one (seconds), rounded to the nearest power of two and kept within
    [`MIN_TOKENS`, `MAX_TOKENS`]. A probe no slower than one token (all fixed cost, as on a GPU
    far from saturation) gives `MAX_TOKENS`: never split."""
    if probe_tokens < 2:
        raise ValueError(f"probe_tokens must be at least 2, got {probe_tokens}")
    per_token = (probe_s - one_token_s) / (probe_tokens - 1)
    if per_token <= 0:
        return MAX_TOKENS
    fixed = max(one_token_s - per_token, 0.0)
    ratio = fixed / per_token
    if ratio < MIN_TOKENS:
        return MIN_TOKENS
    return min(MAX_TOKENS, 1 << round(math.log2(ratio)))


def measure_overhead(model: LanguageModel, pool: KVPool | None = None) -> int:
    """Time 1-token and `PROBE_TOKENS`-token prefills of ``model`` (medians of `REPEATS`, after a
    warm-up of each) and return `overhead_tokens`. The forwards belong to no request: nothing is
    charged for them."""
    probe = min(PROBE_TOKENS, model.max_context)
    times: dict[int, list[float]] = {1: [], probe: []}
    with torch.inference_mode():
        for rep in range(REPEATS + 1):
            for n in times:
                tokens = torch.zeros(1, n, dtype=torch.long, device=model.device)
                cache = new_cache(model, 1, n, pool)
                try:
                    _sync(model.device)
                    start = time.perf_counter()
                    model.forward(tokens, cache, last_only=True)
                    _sync(model.device)
                    if rep:
                        times[n].append(time.perf_counter() - start)
                finally:
                    release_cache(cache)
    return overhead_tokens(statistics.median(times[1]), statistics.median(times[probe]), probe)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
