"""`metaloom bench admit`: admitting many prompts of mixed lengths at once — what a serving
scheduler does when a burst of requests arrives. The 32 mixed chat prompts of `bench serve`
(a few tokens to ~400, each made distinct) go into one `generate` call with greedy decoding of
``--serve-tokens`` tokens, prefilled in groups of similar length (`decode.joining.prefill_groups`,
with the forward overhead measured on this machine: `decode.overhead`) against one forward
padded to the longest prompt. The two sides alternate within each repeat;
medians over repeats. Reported: seconds, forward passes, and whether both produced the same
tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from metaloom.bench import model_args, single_weights
from metaloom.bench.serve_prompts import PROMPTS, tagged
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import load
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams

SIDES = ("grouped", "padded")
PADDED = 10**9  # an overhead no padding outweighs: one forward for every prompt


def _run(gen: LocalGenerator, requests: list[Request]) -> tuple[float, int, list[tuple[int, ...]]]:
    ledger = Ledger()
    start = time.perf_counter()
    out = gen.generate(requests, ledger=ledger)
    return time.perf_counter() - start, ledger.usage.forward_passes, [c[0].token_ids for c in out]


def measure(loaded: LoadedModel, *, prompts: int = 32, tokens: int = 16, repeats: int = 3) -> dict[str, Any]:
    gens = {"grouped": LocalGenerator(loaded), "padded": LocalGenerator(loaded, prefill_overhead_tokens=PADDED)}
    requests = [Request(({"role": "user", "content": tagged(PROMPTS[i % len(PROMPTS)], f"r{i}")},),
                        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)) for i in range(prompts)]
    for gen in gens.values():
        _run(gen, requests[:2])  # warm-up (and the grouped side's overhead measurement)
    seconds: dict[str, list[float]] = {s: [] for s in SIDES}
    passes: dict[str, int] = {}
    outputs: dict[str, list[tuple[int, ...]]] = {}
    for _ in range(repeats):
        for side in SIDES:
            s, passes[side], outputs[side] = _run(gens[side], requests)
            seconds[side].append(s)
    same = sum(a == b for a, b in zip(outputs["grouped"], outputs["padded"], strict=True))
    med = {s: statistics.median(v) for s, v in seconds.items()}
    return {"prompts": prompts, "tokens": tokens, "repeats": repeats, "seconds": med, "forward_passes": passes,
            "overhead_tokens": gens["grouped"].prefill_overhead_tokens(),
            "speedup": med["padded"] / med["grouped"], "same_outputs": same}


HELP = "admitting many prompts of mixed lengths at once: grouped prefill forwards against one padded forward"


def add_args(p: argparse.ArgumentParser) -> None:
    model_args(p, device=True, dtypes="float32")
    p.add_argument("--tokens", "--serve-tokens", dest="serve_tokens", type=int, default=16,
                   help="greedy tokens per prompt")

def main(args: argparse.Namespace) -> int:
    dtype = args.dtype
    loaded = load(args.model, dtype=dtype, device=args.device, weights=single_weights(args))
    result = measure(loaded, tokens=args.serve_tokens, repeats=args.repeats)
    result["model"], result["dtype"] = loaded.name, dtype
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']} ({dtype}): {result['prompts']} mixed prompts admitted at once, {result['tokens']} greedy "
          f"tokens each, median of {result['repeats']}; a forward's overhead measured at {result['overhead_tokens']} "
          "prompt tokens")
    for side in SIDES:
        print(f"  {side:8s} {result['seconds'][side]:7.2f} s  {result['forward_passes'][side]:4d} forwards")
    print(f"  grouped vs padded: {result['speedup']:.2f}x faster; same tokens for {result['same_outputs']}/"
          f"{result['prompts']} prompts")
    return 0
