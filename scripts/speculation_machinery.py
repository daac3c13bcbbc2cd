"""What the speculative decode loop costs when it drafts nothing: plain greedy against the same
requests through the cost model with a drafter that never proposes a token (so every step is the
undrafted step: planning, the plain forward and draw, observing). The difference is the floor of
"never slower": a drafter that rarely drafts cannot run faster than this. Not a test.

    python scripts/speculation_machinery.py [MODEL] [ROUNDS] [ACTIVATIONS]

MODEL: a GGUF or "default"; ROUNDS (default 5) of the three grounded prompts of `bench speculative`
x 128 tokens, plain then speculative each round, after a warm-up round; ACTIVATIONS (default q8).
Prints each round's seconds, the ratio of the medians, and the median time a step spends in the
speculative loop beyond its plain step (each step timed in place).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

import torch

from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.decode import batch as decode_batch
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.kernels.isa import chosen, cpu_name
from metaloom.models.load import load
from metaloom.sampling import SamplingParams
from metaloom.speculative import Draft, Speculative
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.planned import PlannedDrafter


class Nothing:
    """A drafter that never proposes (its state is itself)."""

    name = "nothing"
    num_draft = 8

    def start(self, *args: object) -> Nothing:
        return self

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: object) -> Draft:
        return Draft.from_lists([[] for _ in contexts])

    def observe(self, verified: object) -> None:
        pass

    def select(self, rows: Sequence[int]) -> Nothing:
        return self

    def join(self, other: object) -> Nothing:
        return self


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "default"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    activations = sys.argv[3] if len(sys.argv) > 3 else "q8"
    torch.set_num_threads(2)
    loaded = load(model, weights="native", activations=activations)
    planner = PlannedDrafter([(Nothing(), 8)], cost=measure_verify_cost(loaded.model, most=9), name="nothing")
    plain, spec = LocalGenerator(loaded), LocalGenerator(loaded, speculative=Speculative(planner, 8))
    prompts = PROMPT_SETS["grounded"]
    beyond: list[float] = []  # per speculative step: its time less its plain step's
    plain_step, step_fn = decode_batch.DecodeBatch.plain_step, decode_batch.speculative_step
    inner: list[float] = []

    def timed_plain(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = plain_step(self, *args, **kwargs)
        inner.append(time.perf_counter() - t)
        return out

    def timed_step(batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        inner.clear()
        t = time.perf_counter()
        out = step_fn(batch, *args, **kwargs)
        if inner:
            beyond.append(time.perf_counter() - t - inner[0])
        return out

    decode_batch.DecodeBatch.plain_step = timed_plain  # type: ignore[method-assign]
    decode_batch.speculative_step = timed_step

    def run(gen: LocalGenerator) -> float:
        t = time.perf_counter()
        for p in prompts:
            planner.reset()
            gen.generate([Request.chat(p, SamplingParams(temperature=0, max_tokens=128))], ledger=Ledger())
        return time.perf_counter() - t

    run(plain), run(spec)
    beyond.clear()
    times: dict[str, list[float]] = {"plain": [], "speculative, nothing drafted": []}
    for _ in range(rounds):
        times["plain"].append(run(plain))
        times["speculative, nothing drafted"].append(run(spec))
    print(f"{cpu_name()}, {chosen().name} path, {model}, activations {activations}, {rounds} rounds")
    for name, ts in times.items():
        print(f"  {name}: " + " ".join(f"{t:.3f}" for t in ts) + f" s (median {statistics.median(ts):.3f})")
    ratio = statistics.median(times["plain"]) / statistics.median(times["speculative, nothing drafted"])
    print(f"  speculative / plain speed: {ratio:.3f}x; a step's time beyond its plain step: median "
          f"{statistics.median(beyond) * 1e3:.3f} ms over {len(beyond)} steps")


if __name__ == "__main__":
    main()
