"""Best-of-N with pruning (speculative rejection, Sun et al. 2024, "Fast Best-of-N Decoding
via Speculative Rejection"): score partial generations at checkpoints and stop the weakest
early, so compute goes to the samples likely to win.

Generation advances in chunks of ``chunk_tokens`` on the plain `Generator` interface: the
first chunk is one request with N samples (prompt prefilled once); later chunks continue
each surviving sample exactly from its own tokens (`Request.prefix`; its input tokens are
charged again — as cached tokens when the generator keeps a prefix cache). At each
checkpoint the unfinished samples are scored and only the top ``keep_fraction`` (at least
``min_keep``) continue; finished samples wait for the final comparison. At the end every
surviving sample is scored in one call and the best wins.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    Run,
    component,
    continue_all,
    default_sampling,
    ensure,
    fraction,
    guarded,
    positive,
    sample_n,
    score,
    select_top,
    stop_if_budget,
)
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.protocols import Prompt, Scorer, as_chat


def _mean_logprob() -> SequenceLogprob:
    return SequenceLogprob(normalize=True)


@dataclass(frozen=True)
class PrunedBestOfN:
    """Best-of-N that stops the weakest partial samples at checkpoints (speculative rejection).

    Candidates in the Result are the survivors in sample order; the trace's "prune" events
    name the pruned samples (by their index among the N) with their partial scores.
    ``params.max_tokens`` is not used."""

    n: int = 8
    scorer: Scorer = field(default_factory=_mean_logprob)
    chunk_tokens: int = 32
    keep_fraction: float = 0.5
    min_keep: int = 1
    max_tokens: int = 256
    params: SamplingParams = field(default_factory=default_sampling)

    def __post_init__(self) -> None:
        for name in ("n", "chunk_tokens", "min_keep", "max_tokens"):
            positive(name, getattr(self, name))
        ensure(self.min_keep <= self.n, "min_keep", self.min_keep, f"an integer in [1, n={self.n}]")
        ensure(not isinstance(self.keep_fraction, bool), "keep_fraction", self.keep_fraction, "(0, 1]")
        fraction("keep_fraction", self.keep_fraction)
        component("scorer", self.scorer, Scorer, "a Scorer instance (a name and a score method)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            used = min(self.chunk_tokens, self.max_tokens)
            params = dataclasses.replace(self.params, max_tokens=used)
            run.candidates[:] = sample_n(run, generator, prompt, params, self.n)
            stop_if_budget(run, run.candidates)
            ids = list(range(self.n))  # original sample index of each candidate
            r = 0
            while True:
                live = [k for k, c in enumerate(run.candidates) if c.finish_reason == "length"]
                if not live or used >= self.max_tokens:
                    break
                keep = max(self.min_keep, math.ceil(self.keep_fraction * len(live)))
                if keep < len(live):
                    partial = score(run, self.scorer, prompt, [run.candidates[k] for k in live])
                    kept = {live[j] for j in select_top(partial, keep)}
                    run.event("prune", checkpoint=used, pruned=[ids[k] for k in live if k not in kept],
                              scores={ids[k]: s for k, s in zip(live, partial, strict=True)})
                    stay = [k for k in range(len(run.candidates)) if k not in live or k in kept]
                    run.candidates[:], ids = [run.candidates[k] for k in stay], [ids[k] for k in stay]
                    live = [k for k, c in enumerate(run.candidates) if c.finish_reason == "length"]
                step = min(self.chunk_tokens, self.max_tokens - used)
                r, used = r + 1, used + step
                more = continue_all(run, generator, prompt, [run.candidates[k] for k in live],
                                    dataclasses.replace(self.params, max_tokens=step), r)
                for k, c in zip(live, more, strict=True):
                    run.candidates[k] = c
                stop_if_budget(run, more)
            run.scores[:] = score(run, self.scorer, prompt, run.candidates)
            run.best_index = select_top(run.scores)[0]
            run.event("select", sample=ids[run.best_index], survivors=ids, score=run.scores[run.best_index])

        return guarded(ledger, body)
