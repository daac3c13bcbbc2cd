"""Shared-prefix attention's kernel alone: one layer's fused attention over N forks of a
random-token prompt, on and off, alternated on fresh forks, times the model's layers. No decode
steps run in the process (in `metaloom bench fork --case shared` they do, and both sides' times
move with them). usage: python scripts/shared_attention.py [PROMPT_TOKENS [ROWS [REPEATS]]]"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

from metaloom.bench.fork_shared import _attention_s
from metaloom.models import load
from metaloom.models.kernels.isa import cpu_name


def main() -> None:
    prefix, rows, repeats = (int(a) for a in (sys.argv[1:] + ["4000", "64", "3"][len(sys.argv) - 1:])[:3])
    model = load("default", dtype="float32", weights="dense").model
    pool = model.new_pool(slots=prefix + rows * 4 + 2)
    root = model.new_cache(1, prefix + 2, pool=pool)
    ids = np.random.default_rng(0).integers(100, model.vocab_size - 100, prefix).tolist()
    model.forward(torch.tensor([ids]), root, last_only=True)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(repeats):
        for side in times:
            cache = root.fork([0] * rows)
            times[side].append(_attention_s(model, cache, side == "on", 9))
            cache.release()
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, SmolLM2 float32: {rows} rows x {prefix}-token prompt, "
          f"attention per step on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, {off / on:.2f}x")


if __name__ == "__main__":
    main()
