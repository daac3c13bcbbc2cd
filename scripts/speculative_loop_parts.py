"""Where the speculative decode loop's time goes, function by function: plain greedy and one
drafter under the cost model (or `auto`), alternating in one process on the prompts of `bench
speculative`, each decode-loop function of interest wrapped in a timer. Not a test.

    python scripts/speculative_loop_parts.py DRAFTER PROMPTS ROUNDS [MODEL [DRAFT_MODEL]]

DRAFTER: a registered drafter (ngram, heads, recycling, jacobi, draft, ...) or auto; PROMPTS:
free or grounded; MODEL: a GGUF or "default" (q8 activations); DRAFT_MODEL for "draft" and auto.
Prints, per mode, the median over ROUNDS of the wall time of the whole set and of each wrapped
function (summed over its calls), with its number of calls. Totals of nested functions overlap
(`step` holds `propose`, which holds `plan`).
"""

from __future__ import annotations

import collections
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import metaloom.decode.batch as batch
import metaloom.decode.speculative_step as step
import metaloom.models.engine.llama as llama
import metaloom.speculative.planned as planned
import metaloom.speculative.planned_state as planned_state
from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import load
from metaloom.sampling import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.registry import DRAFTERS, DrafterOptions, auto_candidates, build_drafter

TOTALS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def wrap(owner: Any, name: str, label: str) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - began
            CALLS[label] += 1

    setattr(owner, name, timed)


def main() -> None:
    which, prompt_set, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = sys.argv[4] if len(sys.argv) > 4 else "default"
    options = DrafterOptions(draft_model=sys.argv[5] if len(sys.argv) > 5 else None)
    for owner, name in ((batch.DecodeBatch, "step"), (batch.DecodeBatch, "plain_step"), (llama.LlamaModel, "forward"),
                        (llama.LlamaModel, "forward_hidden"), (planned_state.PlannedState, "propose"),
                        (planned_state.PlannedState, "observe"), (planned.PlannedDrafter, "plan"),
                        (planned.PlannedDrafter, "learn"), (step, "_undrafted_step"), (step, "tree_step")):
        wrap(owner, name, name)
    loaded = load(model, activations="q8")
    candidates = (auto_candidates(loaded, options) if which == "auto"
                  else [(build_drafter(which, loaded, options), DRAFTERS[which].num_draft)])
    for drafter, _ in candidates:  # each drafter state's own propose and observe
        state = type(drafter.start(loaded.model, *_start_args(loaded)))
        for name in ("propose", "observe"):
            if name in vars(state):
                wrap(state, name, f"{state.__name__}.{name}")
    cost = measure_verify_cost(loaded.model, most=1 + max(k for _, k in candidates))
    planner = planned.PlannedDrafter(candidates, cost=cost, name=which)
    spec = LocalGenerator(loaded, speculative=Speculative(planner, max(k for _, k in candidates)))
    plain = LocalGenerator(loaded)
    prompts = PROMPT_SETS[prompt_set]

    def run(gen: LocalGenerator, reset: bool) -> int:
        n = 0
        for p in prompts:
            if reset:
                planner.reset()
            out = gen.generate([Request.chat(p, SamplingParams(temperature=0, max_tokens=128))], ledger=Ledger())
            n += len(out[0][0].token_ids)
        return n

    run(plain, False)
    run(spec, True)
    seen: dict[str, list[tuple[float, int, dict[str, float], dict[str, int]]]] = {}
    for _ in range(rounds):
        for mode, gen, reset in (("plain", plain, False), ("speculative", spec, True)):
            TOTALS.clear()
            CALLS.clear()
            began = time.perf_counter()
            n = run(gen, reset)
            seen.setdefault(mode, []).append((time.perf_counter() - began, n, dict(TOTALS), dict(CALLS)))
    for mode, runs in seen.items():
        print(f"{mode}: {statistics.median(r[0] for r in runs) * 1e3:.1f} ms, {runs[0][1]} tokens")
        for label in sorted(runs[0][2]):
            ms = statistics.median(r[2].get(label, 0.0) for r in runs) * 1e3
            print(f"   {label:28s} {ms:8.1f} ms  {runs[0][3][label]} calls")


def _start_args(loaded: Any) -> tuple[Any, ...]:
    from metaloom.sampling.pipeline import make_sampler

    sampler = make_sampler([SamplingParams(temperature=0, max_tokens=8)], loaded.model.vocab_size, loaded.model.device)
    return sampler, [[1, 2]], [0]


if __name__ == "__main__":
    main()
