"""`metaloom bench fork --case shared`: shared-prefix attention (Hydragen) on and off.

N samples forked from one long prompt decode greedily, one token per row per step, with
``--shared-prefix-attention on`` and ``off`` (`metaloom.models.engine.options`): the same weights,
the same forked cache state (one prefill per prompt length, forked afresh for each side), sides
alternated within each repeat. Per (prompt length, rows):

- attention: the fused kernel's time for one layer's attention over the forked rows (RoPE, the
  new key's write, attention; `FusedKernels.rope_attend`) times the layers, median of calls;
- step: a whole decode step through the model (median over the steps of a run, then over
  repeats), and the speedup of each.

The prompt is random token ids: attention's cost does not depend on what the tokens say.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.sharing import find_sharing

SIDES = ("on", "off")


def _attention_s(model: LlamaModel, cache: Any, sharing: bool, calls: int) -> float:
    """Median seconds of one layer's fused attention over ``cache``'s rows (a decode step's
    attention, at each row's next position) times the model's layers."""
    kernels = model.fused
    if kernels is None:
        raise InvalidParameter("model", "no fused kernels", "a model whose one-token steps take the fused kernels")
    c = model.config
    b = cache.batch
    lengths = cache.lengths.contiguous()
    fresh = cache.prepare_host([1] * b, 1)  # each row's new position gets its slot, as a step's prepare does
    shared = find_sharing(cache.slots, cache.host_lengths()) if sharing else None
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, generator=g).to(model.dtype)
    out = qkv.new_empty(b, c.num_attention_heads * c.head_dim)
    pool, table = cache.pool, cache.table()
    threads = torch.get_num_threads()
    times = []
    for _ in range(calls + 1):  # the first call warms up
        start = time.perf_counter()
        kernels.rope_attend(qkv, model._cos, model._sin, lengths, table, pool.keys[0], pool.values[0], out,
                            c.num_attention_heads, c.sliding_window, threads, shared)
        times.append(time.perf_counter() - start)
    cache.pool.release(fresh[:, 0])  # the rows never advanced into them
    return statistics.median(times[1:]) * c.num_hidden_layers


def _steps_s(model: LlamaModel, cache: Any, tokens: int) -> float:
    """Median seconds of a greedy decode step over ``cache``'s rows (``tokens`` steps)."""
    b = cache.batch
    token = torch.arange(1, b + 1, device=model.device) % model.vocab_size  # the rows go different ways
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        out = model.forward(token[:, None], cache)
        token = out[:, -1].argmax(-1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_shared(model: LlamaModel, prefixes: list[int], rows: list[int], tokens: int = 8, repeats: int = 3,
                   calls: int = 9) -> dict[str, Any]:
    """Attention and step times with shared-prefix attention on and off, per (prefix, rows)."""
    for name, value in (("tokens", tokens), ("repeats", repeats), ("calls", calls)):
        if not isinstance(value, int) or value < 1:
            raise InvalidParameter(name, value, "an integer >= 1")
    if not isinstance(model, LlamaModel) or model.fused is None:
        raise InvalidParameter("model", type(model).__name__, "the native model with its fused CPU kernels")
    if model.config.sliding_window is not None:
        raise InvalidParameter("model", "sliding window", "a model without a sliding window (shared spans differ)")
    for p in prefixes:
        if p < 1 or p + tokens + 2 > model.max_context:
            raise InvalidParameter("prefixes", p, f"prompt lengths in [1, {model.max_context - tokens - 2}]")
    sides = {m: model.with_options(replace(model.options, shared_prefix_attention=m)) for m in SIDES}  # the rest as loaded
    gen = np.random.default_rng(0)
    edge = min(100, model.vocab_size // 4)  # away from the special tokens at either end
    cells = []
    for prefix in prefixes:
        prompt = torch.tensor([gen.integers(edge, model.vocab_size - edge, prefix).tolist()], device=model.device)
        pool = model.new_pool(slots=prefix + max(rows) * (tokens + 2) + 2)
        root = model.new_cache(1, prefix + tokens + 2, pool=pool)
        start = time.perf_counter()
        model.forward(prompt, root, last_only=True)
        prefill_s = time.perf_counter() - start
        for n in rows:
            runs: dict[str, dict[str, list[float]]] = {m: {"attention_s": [], "step_s": []} for m in SIDES}
            for _ in range(repeats):
                # attention first, both sides on one fork back to back: a step's matmuls between
                # them leave the threads in another state (measured: both sides' calls ran up
                # to 1.7x slower, unevenly, right after steps)
                cache = root.fork([0] * n)
                for m in SIDES:
                    runs[m]["attention_s"].append(_attention_s(sides[m], cache, m == "on", calls))
                cache.release()
                for m in SIDES:
                    cache = root.fork([0] * n)
                    runs[m]["step_s"].append(_steps_s(sides[m], cache, tokens))
                    cache.release()
            cell: dict[str, Any] = {"prefix_tokens": prefix, "rows": n, "prefill_s": prefill_s}
            for m in SIDES:
                cell[m] = {k: statistics.median(v) for k, v in runs[m].items()}
            cell["attention_speedup"] = cell["off"]["attention_s"] / cell["on"]["attention_s"]
            cell["step_speedup"] = cell["off"]["step_s"] / cell["on"]["step_s"]
            cells.append(cell)
        root.release()
    return {"tokens": tokens, "repeats": repeats, "cells": cells}


def print_shared(result: dict[str, Any]) -> None:
    print(f"{result['model']} ({result['dtype']}, {result['cpu']}, {result['threads']} threads): "
          f"shared-prefix attention on vs off; medians of {result['repeats']} alternated repeats, "
          f"{result['tokens']} greedy steps each")
    print(f"{'prefix':>7} {'rows':>5} {'attention ms on':>16} {'off':>9} {'speedup':>8} {'step ms on':>11} {'off':>9} "
          f"{'speedup':>8}")
    for c in result["cells"]:
        on, off = c["on"], c["off"]
        print(f"{c['prefix_tokens']:>7} {c['rows']:>5} {on['attention_s'] * 1e3:>16.1f} {off['attention_s'] * 1e3:>9.1f} "
              f"{c['attention_speedup']:>7.2f}x {on['step_s'] * 1e3:>11.1f} {off['step_s'] * 1e3:>9.1f} "
              f"{c['step_speedup']:>7.2f}x")
