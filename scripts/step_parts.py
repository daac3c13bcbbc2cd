"""Where a decode step's time goes besides its forward: plain greedy and the same requests with
a drafter at a fixed draft length, each part of the step (the forward, the draw or the verify,
emitting, the cache's roll-back, the drafter's propose and observe) timed in place; not a test.

    python scripts/step_parts.py [DRAFTER [K [PROMPTS [ROUNDS [planned|fresh]]]]]

DRAFTER: a `metaloom.speculative.registry` name (default recycling, whose K is then a chain of
K nodes as a tree), or auto (every candidate of `--speculative auto` under the cost model, each
at its own K; K is then ignored); K: its draft tokens a step (default 1); PROMPTS: grounded
(default) or free, `metaloom bench speculative`'s; ROUNDS (default 2) after a warm-up round;
``planned``: the drafter under the cost model (`PlannedDrafter`, K its most a step, the verify
cost measured first, as `bench speculative --cost-model on`), its planning and learning timed
too; ``fresh``: the same, its estimates forgotten before each request, as the bench's are. The default model on
native weights with q8 activations. Prints per round each part's calls and mean ms a call; what
a step spends beyond its forward is the step's time less the forward's. Wrapping costs about a
microsecond a call. The parts are the functions the decode loop calls by name
(`metaloom.decode.batch`, `metaloom.decode.speculative_step`), so a part renamed there is
missing here, not silently zero.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import metaloom.decode.batch as batch
import metaloom.decode.speculative_step as step
from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.load import load
from metaloom.sampling import SamplingParams
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative import Speculative
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.drafter import Draft
from metaloom.speculative.planned import PlannedDrafter, PlannedState
from metaloom.speculative.registry import AUTO, DrafterOptions, auto_candidates, build_drafter

TIMES: collections.defaultdict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: Any, attr: str, label: str) -> None:
    """Replace ``owner.attr`` by itself timed under ``label``."""
    inner: Callable[..., Any] = getattr(owner, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - began
            CALLS[label] += 1

    setattr(owner, attr, wrapper)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "recycling"
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    prompts = PROMPT_SETS[sys.argv[3] if len(sys.argv) > 3 else "grounded"]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    torch.set_num_threads(2)
    loaded = load("default", weights="native", activations="q8")
    planned = len(sys.argv) > 5 and sys.argv[5] in ("planned", "fresh")
    if name == AUTO:  # `--speculative auto`: every candidate under the cost model, each at its own K
        candidates = auto_candidates(loaded, DrafterOptions())
        drafter, k, planned = candidates[0][0], max(n for _, n in candidates), True
    else:
        options = DrafterOptions(tree="static:" + ",".join(["1"] * k)) if name == "recycling" else DrafterOptions()
        drafter = build_drafter(name, loaded, options)
        candidates = [(drafter, k)]
    for owner, attr, label in (
            (batch, "speculative_step", "speculative step"), (batch, "charged_forward_both", "plain: forward"),
            (batch, "draw", "plain: draw"), (batch, "emit_drawn", "plain: emit"),
            (batch.DecodeBatch, "plain_step", "plain step"), (batch.DecodeBatch, "measure", "measure KV"),
            (step, "charged_forward_both", "drafted: forward"), (step, "verify", "verify"),
            (step, "verify_tree", "verify_tree"), (step, "tree_step", "tree step"),
            (step, "emit_verified", "drafted: emit"), (step, "_checked", "check draft"),
            (PagedKVCache, "truncate", "truncate"), (PagedKVCache, "keep_entries", "keep_entries"),
            (Draft, "tree_attention", "tree masks")):
        timed(owner, attr, label)
    sampler = make_sampler([SamplingParams(temperature=0)], loaded.model.vocab_size, loaded.model.device)
    for d, _ in candidates:  # each drafter's per-batch state's class
        state = type(d.start(loaded.model, sampler, [[1, 2]], [0]))
        suffix = f" {d.name}" if len(candidates) > 1 else ""
        timed(state, "propose", "propose" + suffix)
        timed(state, "observe", "observe" + suffix)
    fresh = len(sys.argv) > 5 and sys.argv[5] == "fresh"
    if planned:
        drafter = PlannedDrafter(candidates, cost=measure_verify_cost(loaded.model, most=1 + k), name=name)
        for owner, attr, label in ((PlannedState, "propose", "planned: propose"), (PlannedState, "observe", "planned: observe"),
                                   (PlannedState, "plain_ahead", "planned: plain_ahead"), (PlannedDrafter, "plan", "plan"),
                                   (PlannedDrafter, "keep", "keep"), (PlannedDrafter, "afford", "afford"),
                                   (PlannedDrafter, "learn", "learn")):
            timed(owner, attr, label)
    plain, speculative = LocalGenerator(loaded), LocalGenerator(loaded, speculative=Speculative(drafter, k))

    def run(gen: LocalGenerator) -> float:
        began = time.perf_counter()
        for p in prompts:
            if fresh and isinstance(drafter, PlannedDrafter):  # each request learns from nothing, as the bench's
                drafter.reset()
            gen.generate([Request.chat(p, SamplingParams(temperature=0, max_tokens=128))], ledger=Ledger())
        return time.perf_counter() - began

    run(plain)
    run(speculative)
    for r in range(rounds):
        for label, gen in (("plain", plain), (f"{name}, K={k}", speculative)):
            TIMES.clear()
            CALLS.clear()
            seconds = run(gen)
            parts = ", ".join(f"{part} {CALLS[part]} x {TIMES[part] / CALLS[part] * 1e3:.3f}" for part in TIMES)
            print(f"round {r + 1}, {label}: {seconds:.3f} s; ms a call: {parts}")


if __name__ == "__main__":
    main()
