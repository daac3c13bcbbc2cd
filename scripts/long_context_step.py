"""One-token decode steps at long context, batch 1: the median milliseconds of a step after a
prompt of each length (random tokens), on native quantised weights (float32 activations). What grouped-query attention
costs as the context grows (issue 47, item 5: decode attention reads each key once per group).
usage: python scripts/long_context_step.py [MODEL [LENGTHS [STEPS]]]
  e.g. python scripts/long_context_step.py default 400,4000 32
Run it from two checkouts, alternating, to compare kernels side by side."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from metaloom.models import load
from metaloom.models.kernels.isa import cpu_name


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "default"
    lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "400,4000").split(",")]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    model = load(spec, weights="native").model
    config = model.config
    out = {"model": spec, "cpu": cpu_name(), "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
           "ms_per_step": {}}
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for n in lengths:
            cache = model.new_cache(1, n + steps + 1)
            ids = rng.integers(100, model.vocab_size - 100, n).tolist()
            logits = model.forward(torch.tensor([ids]), cache, last_only=True)
            times = []
            for _ in range(steps):
                token = torch.tensor([[int(logits[0, -1].argmax())]])
                start = time.perf_counter()
                logits = model.forward(token, cache)
                times.append(time.perf_counter() - start)
            out["ms_per_step"][n] = round(1000 * statistics.median(times), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
