"""`metaloom bench fork`: what forking costs — 64 branches of a 2,000-token prefix, each
decoding 32 tokens, with forks that share the prefix's keys and values (the KV pool's slot
tables, `metaloom.models.engine.cache`) against forks that copy them (what a dense per-row cache
does). The same model, the same decode steps (greedy, one forward per step for all branches),
alternated within each repeat; medians over repeats.

Reported per side: KV memory right after the fork and at the end (in units of the prefix's own
KV memory: the prefix alone is 1.0, and the 64 x 32 new tokens add their own ~1.0 at the end),
the memory of the fork itself (KV plus slot tables, beyond the prefix), and seconds for the
fork and for the 32 steps.

``--case shared`` measures something else: shared-prefix attention on and off over forked rows
(`metaloom.bench.fork_shared`), at each ``--prefixes`` x ``--rows``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from metaloom.bench import model_args, single_weights
from metaloom.errors import InvalidParameter
from metaloom.models import load
from metaloom.models.engine.cache import PagedKVCache


def copied(cache: PagedKVCache, rows: list[int]) -> PagedKVCache:
    """A fork that copies: row i gets fresh slots holding a copy of row ``rows[i]``'s keys and
    values (what `fork` costs with a dense [B, H, capacity, D] cache). Each row's keys are
    read once per layer and written as one block when its new slots are contiguous (a fresh
    pool hands them out in order), so the copy runs at memory speed."""
    pool = cache.pool
    new = PagedKVCache(pool, len(rows), cache.capacity)
    lengths = cache.lengths.tolist()
    for i, r in enumerate(rows):
        n = int(lengths[r])
        src = torch.from_numpy(cache.row_slots(r, 0, n)).to(pool.device)
        dst_np = pool.allocate(n)
        block = n > 0 and int(dst_np[-1]) - int(dst_np[0]) == n - 1 and bool((np.diff(dst_np) == 1).all())
        dst = slice(int(dst_np[0]), int(dst_np[-1]) + 1) if block else torch.from_numpy(dst_np).to(pool.device)
        for stored in pool.tensors():  # keys, values, and an int8 pool's scales
            stored[dst] = stored[src]
        new.slots[i, :n] = dst_np
        new._n[i] = n
    new._lengths = None
    return new


def _one(model: Any, prompt: list[int], branches: int, tokens: int, share: bool) -> dict[str, float]:
    # each side's pool is made large enough up front, so neither pays for growing it
    copies = 0 if share else branches * len(prompt)
    pool = model.new_pool(slots=len(prompt) + copies + branches * (tokens + 1) + 1)
    root = model.new_cache(1, len(prompt) + tokens + 1, pool=pool)
    logits = model.forward(torch.tensor([prompt], device=model.device), root, last_only=True)[:, -1]
    prefix_slots = pool.used_slots
    start = time.perf_counter()
    forked = root.fork([0] * branches) if share else copied(root, [0] * branches)
    fork_s = time.perf_counter() - start
    root.release()
    at_fork = pool.used_slots
    tables = forked.slots.nbytes
    token = logits.argmax(-1).expand(branches).clone()
    token[1:] = torch.arange(1, branches, device=token.device) % model.vocab_size  # branches go different ways
    start = time.perf_counter()
    for _ in range(tokens):
        out = model.forward(token[:, None], forked)
        token = out[:, -1].argmax(-1)
    decode_s = time.perf_counter() - start
    end = pool.used_slots
    forked.release()
    per = pool.bytes_per_slot
    prefix_bytes = prefix_slots * per
    return {"fork_s": fork_s, "decode_s": decode_s, "kv_at_fork": at_fork / prefix_slots, "kv_at_end": end / prefix_slots,
            "fork_overhead": (at_fork * per + tables - prefix_bytes) / prefix_bytes, "prefix_mb": prefix_bytes / 2**20,
            "end_mb": (end * per + tables) / 2**20}


def measure(model: Any, prefix_tokens: int = 2000, branches: int = 64, tokens: int = 32, repeats: int = 3) -> dict[str, Any]:
    """Median figures of shared and copying forks (alternated within each repeat)."""
    for name, value in (("prefix_tokens", prefix_tokens), ("branches", branches), ("tokens", tokens), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise InvalidParameter(name, value, "an integer >= 1")
    if not hasattr(model, "new_pool"):
        raise InvalidParameter("model", type(model).__name__, "the native model (its KV pool)")
    g = np.random.default_rng(0)
    prompt = g.integers(100, model.vocab_size - 100, prefix_tokens).tolist()
    runs: dict[str, list[dict[str, float]]] = {"shared": [], "copied": []}
    _one(model, prompt[:64], 4, 2, True)  # warm-up
    for _ in range(repeats):
        for side in runs:
            runs[side].append(_one(model, prompt, branches, tokens, side == "shared"))
    out: dict[str, Any] = {"prefix_tokens": prefix_tokens, "branches": branches, "tokens": tokens, "repeats": repeats}
    for side, rows in runs.items():
        out[side] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["decode_speedup"] = out["copied"]["decode_s"] / out["shared"]["decode_s"]
    out["fork_speedup"] = out["copied"]["fork_s"] / out["shared"]["fork_s"]
    return out


HELP = "what forking costs: branches that share a prefix's keys against branches that copy them"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, device=True, dtypes="float32")
    p.add_argument("--case", default="copy", choices=("copy", "shared"),
                   help="copy: shared vs copied forks (memory, fork and decode time); shared: shared-prefix "
                        "attention on vs off over forked rows")
    p.add_argument("--prefixes", default="2000,8000", help="--case shared: prompt lengths, comma-separated")
    p.add_argument("--rows", default="16,64", help="--case shared: forked rows, comma-separated")
    p.add_argument("--tokens", type=int, default=8, help="--case shared: decode steps a side runs each repeat")

def main(args: argparse.Namespace) -> int:
    loaded = load(args.model, dtype=args.dtype, device=args.device, weights=single_weights(args))
    if args.case == "shared":
        return _shared(args, loaded)
    result = measure(loaded.model, repeats=args.repeats)
    result["model"], result["dtype"] = loaded.name, args.dtype
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']} ({result['dtype']}): {result['branches']} branches of a {result['prefix_tokens']}-token "
          f"prefix, {result['tokens']} tokens each; prefix KV {result['shared']['prefix_mb']:.1f} MB")
    for side in ("shared", "copied"):
        r = result[side]
        print(f"  {side:7s} KV at fork {r['kv_at_fork']:6.2f}x prefix (fork overhead {r['fork_overhead']:.3f}x), "
              f"at end {r['kv_at_end']:6.2f}x ({r['end_mb']:.0f} MB); fork {r['fork_s'] * 1e3:8.1f} ms, "
              f"32 steps {r['decode_s']:.2f} s")
    print(f"  shared vs copied: fork {result['fork_speedup']:.0f}x faster, decode {result['decode_speedup']:.2f}x faster")
    return 0


def _shared(args: argparse.Namespace, loaded: Any) -> int:
    from metaloom.bench.fork_shared import measure_shared, print_shared
    from metaloom.models.kernels.isa import chosen, cpu_name

    result = measure_shared(loaded.model, _ints("prefixes", args.prefixes), _ints("rows", args.rows),
                            tokens=args.tokens, repeats=args.repeats)
    result.update(model=loaded.name, dtype=args.dtype, weights=loaded.weights, cpu=cpu_name(), isa=chosen().name,
                  threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(result))
    else:
        print_shared(result)
    return 0


def _ints(param: str, value: str) -> list[int]:
    """Comma-separated whole numbers >= 1, else `InvalidParameter` naming ``param``."""
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise InvalidParameter(param, value, "comma-separated whole numbers >= 1")
    return out
