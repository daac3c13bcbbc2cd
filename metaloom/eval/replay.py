"""One pool of samples per problem, shared by every sampling strategy of a sweep.

Majority vote, weighted vote, best-of-N and MBR at the same N, temperature and seed ask the
generator the same request, and seeded sampling gives the same samples; drawing them once per
problem and replaying them to the other strategies changes no result. Each strategy is still
charged what the draw cost (the recorded usage, seconds included), because that is what it
would have cost on its own: the saving is the sweep's, not the strategy's.

Only a run's first call is replayed, when it is a single seeded request (the sampling call of
a pooled strategy): later calls of a run depend on what its own prefix cache holds, so the
same request could cost another run a different amount; an unseeded request must draw fresh
samples. For the same reason the runner wraps only pooled strategies' runs: a replayed call
leaves nothing in the run's prefix cache, so a run that goes on after it (a tree search whose
root expansion matched another's) would pay again for prefixes a real run has cached. The cache holds one problem's
draws: the runner clears it when the problem changes.

Pools outlive the process: the driver keeps each problem's draws in ``DIR/pools/`` (`dump` /
`load`: every field of every completion, log-probabilities exact, and the recorded cost), and
hands them to the worker that runs a later pooled job of that problem. A strategy added to a
finished sweep (best-of-N with a judge after majority vote) then scores the very samples the
vote counted — its record pairs with theirs sample for sample — and the sweep does not draw
them again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from metaloom.generator.types import Completion, Request
from metaloom.ledger import COUNTED, Ledger

Draws = dict[str, tuple[list[Completion], dict[str, float]]]


def _key(request: Request) -> str | None:
    if request.params.seed is None:
        return None
    return repr((request.prompt, request.prefix, request.params))


class ReplayGenerator:
    """A `Generator` wrapper that replays seeded single requests it has already served."""

    def __init__(self, inner: Any, draws: Draws | None = None) -> None:
        self.inner = inner
        self.draws: Draws = {} if draws is None else draws  # shared by the runs of one problem
        self.replayed = 0  # calls served from the cache
        self.calls = 0

    def __getattr__(self, name: str) -> Any:  # render, score, stream, capabilities, tokenizer, model ...
        return getattr(self.inner, name)

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        first, self.calls = self.calls == 0, self.calls + 1
        key = _key(requests[0]) if len(requests) == 1 and first else None
        if key is not None and key in self.draws:
            completions, cost = self.draws[key]
            self.replayed += 1
            ledger.charge(**cost)
            return [list(completions)]
        child = ledger.child()
        try:
            out = self.inner.generate(requests, ledger=child)
        finally:
            # what the draw cost, charged where the caller expects it (the child's parent)
            spent = {name: getattr(child.usage, name) for name in COUNTED if getattr(child.usage, name)}
        if key is not None and not child.usage.unknown:
            self.draws[key] = (list(out[0]), spent)
        return out


def _completion(d: dict[str, Any]) -> Completion:
    def tuples(x: Any) -> Any:
        return None if x is None else tuple(x)

    top = d.get("top_logprobs")
    return Completion(text=d["text"], token_ids=tuple(d["token_ids"]), logprobs=tuple(d["logprobs"]),
                      finish_reason=d["finish_reason"], stop_reason=d.get("stop_reason"), score=d.get("score"),
                      decoder_logprobs=tuples(d.get("decoder_logprobs")), error=d.get("error"),
                      top_logprobs=None if top is None else tuple(tuple((int(t), float(lp)) for t, lp in pos)
                                                                   for pos in top))


def dump(draws: Draws) -> str:
    """``draws`` as JSON text (floats in their shortest exact form; -inf as -Infinity)."""
    return json.dumps({key: {"completions": [dataclasses.asdict(c) for c in completions], "cost": cost}
                       for key, (completions, cost) in draws.items()})


def load(text: str) -> Draws:
    """The `Draws` that `dump` wrote."""
    return {key: ([_completion(c) for c in v["completions"]], dict(v["cost"]))
            for key, v in json.loads(text).items()}
