"""When the fused step's attention should split over threads: a forward of W tokens (one row, a
chain verify's shape; W = 1 is a decode step) after a prompt of P random tokens, timed with
attention on one thread and split over PyTorch's threads, the two alternating on the same cache
(rolled back after each forward, as a rejected draft is). Prints the median ms of each, from
round 3 on. `fused_step.PARALLEL_MIN_KEYS` (rows x cached keys) decides the split in the engine.
usage: python scripts/attention_threads.py [MODEL [ACTIVATIONS [POSITIONS [WIDTHS [ROUNDS]]]]]
  e.g. python scripts/attention_threads.py default q8 8,30,60,300,1000 1,2,4,6 20"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import metaloom.models.engine.fused_step as fused_step
from metaloom.models import load
from metaloom.models.kernels.isa import ENV, cpu_name, resolve

ONE, SPLIT = 10**9, 0  # PARALLEL_MIN_KEYS that keep attention on one thread, and that always split it


def main() -> None:
    args = sys.argv[1:] + [""] * 5
    spec, activations = args[0] or "default", args[1] or "q8"
    positions = [int(p) for p in (args[2] or "8,30,60,300,1000").split(",")]
    widths = [int(w) for w in (args[3] or "1,2,4,6").split(",")]
    rounds = int(args[4] or 20)
    model = load(spec, weights="native", activations=activations).model
    heads = f"{model.config.num_attention_heads} / {model.config.num_key_value_heads} heads"
    print(f"{cpu_name()} ({resolve(os.environ.get(ENV)).name} path), {torch.get_num_threads()} threads, {spec}, "
          f"{activations} activations, {heads}; ms: one thread -> split")
    kept = fused_step.PARALLEL_MIN_KEYS
    try:
        with torch.no_grad():
            for n in positions:
                cache = model.new_cache(1, n + max(widths) + 1)
                model.forward(torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0)), cache,
                              last_only=True)
                start = torch.as_tensor(cache.host_lengths().copy())
                tokens = {w: torch.randint(100, 40000, (1, w), generator=torch.Generator().manual_seed(w))
                          for w in widths}
                times: dict[tuple[int, int], list[float]] = {(w, k): [] for w in widths for k in (ONE, SPLIT)}
                for r in range(rounds):
                    for w in widths:
                        for k in (ONE, SPLIT) if r % 2 else (SPLIT, ONE):
                            fused_step.PARALLEL_MIN_KEYS = k
                            t0 = time.perf_counter()
                            model.forward(tokens[w], cache, last_only=False)
                            times[w, k].append(time.perf_counter() - t0)
                            cache.truncate(start)
                cells = [f"W={w}: {statistics.median(times[w, ONE][2:]) * 1e3:.2f} -> "
                         f"{statistics.median(times[w, SPLIT][2:]) * 1e3:.2f}" for w in widths]
                print(f"P={n:5d}  " + "  ".join(cells), flush=True)
                cache.release()
    finally:
        fused_step.PARALLEL_MIN_KEYS = kept


if __name__ == "__main__":
    main()
