"""What a speculative verify forward costs against a one-token step, on the default model:
(1) a chain of T tokens after a 400-token prompt, for T = 1, 2, 4, 8, 12, 16, 24, 32; (2) a
21-token tree (4.2.1 under the pending token) after prompts of 400 to 4,000 tokens, with
shared-prefix attention off and on. Each forward is timed on the same prefilled cache, rolled
back after each (as a rejected draft is), median of 10 after 2 warm-ups. The figures in
docs/engine.md and docs/performance.md come from it.

usage: python scripts/verify_cost.py [--weights native|dense] [--dtype float32|bfloat16] [--activations float|q8]
    [--positions N]"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from metaloom.models import load
from metaloom.models.kernels.isa import cpu_name
from metaloom.speculative.tree import DraftTree, attention_mask


def _ms(model, cache, tokens: torch.Tensor, tree: torch.Tensor | None = None, repeats: int = 10) -> float:
    start = torch.as_tensor(cache.host_lengths().copy())
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        model.forward(tokens, cache, tree=tree)
        times.append(time.perf_counter() - t0)
        cache.truncate(start)
    return statistics.median(times[2:]) * 1e3


def _prefilled(model, tokens: int):
    cache = model.new_cache(1, tokens + 64)
    model.forward(torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0)), cache,
                  last_only=True)
    return cache


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default="native")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--activations", default="float")
    p.add_argument("--positions", type=int, default=400, help="the chains' prompt length")
    args = p.parse_args()
    model = load("default", dtype=args.dtype, weights=args.weights, activations=args.activations).model
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, SmolLM2-135M {args.weights} {args.dtype}, "
          f"{args.activations} activations")
    cache = _prefilled(model, args.positions)
    for t in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32):
        ms = _ms(model, cache, torch.randint(100, 40000, (1, t)))
        print(f"chain of {t:2d} after {args.positions} tokens: {ms:6.2f} ms")
    parents: list[int] = []
    level = [-1]
    for width in (4, 2, 1):  # 4 under the pending token, 2 under each, 1 under each: 20 nodes
        below = []
        for parent in level:
            for _ in range(width):
                parents.append(parent)
                below.append(len(parents) - 1)
        level = below
    tree = DraftTree(tokens=tuple(100 + i for i in range(len(parents))), parents=tuple(parents))
    mask, tokens = attention_mask(tree)[None], torch.tensor([[7, *tree.tokens]])
    for prompt in (400, 1000, 2000, 4000):
        row = []
        for mode in ("off", "on"):
            m = model.with_options(replace(model.options, shared_prefix_attention=mode))
            c = _prefilled(m, prompt)
            row.append(_ms(m, c, tokens, mask))
            step = _ms(m, c, tokens[:, :1])
        print(f"tree of {len(parents)} after {prompt:4d} tokens: sharing off {row[0]:6.1f} ms, on {row[1]:6.1f} ms;"
              f" one-token step {step:5.1f} ms")


if __name__ == "__main__":
    main()
