"""Best-of-N (rejection sampling): draw N samples, keep the one a scorer likes best —
argmax_i v(y_i) approximates argmax_y A(y) as N grows, as far as v tracks A (Stiennon et
al. 2020; Nakano et al. 2022; Cobbe et al. 2021 on verifier over-optimisation).

The scorer is a choice: sequence log-probability (raw or per token), an outcome reward
model, an LLM judge, a user's verifier, or code execution against tests (`metaloom.score`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    Run,
    collect,
    component,
    default_sampling,
    ensure,
    guarded,
    positive,
    score,
    select_top,
)
from metaloom.meta.types import Result, Strategy
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.protocols import Prompt, Scorer, as_chat


def _mean_logprob() -> SequenceLogprob:
    return SequenceLogprob(normalize=True)


@dataclass(frozen=True)
class BestOfN:
    """Sample N, keep the candidate the scorer ranks highest.

    ``n`` samples (one request: the prompt is prefilled and charged once, or ``n`` runs of
    ``inner``), one scorer call over all of them, the top score wins (earliest on ties)."""

    n: int = 4
    scorer: Scorer = field(default_factory=_mean_logprob)
    params: SamplingParams = field(default_factory=default_sampling)
    extractor: Extractor | None = None
    inner: Strategy | None = None

    def __post_init__(self) -> None:
        positive("n", self.n)
        component("scorer", self.scorer, Scorer, "a Scorer instance (a name and a score method)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)
        component("inner", self.inner, Strategy, "None or a Strategy instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            candidates = collect(run, generator, prompt, self.params, self.n, self.extractor, inner=self.inner)
            run.scores.extend(score(run, self.scorer, prompt, candidates))
            run.best_index = select_top(run.scores)[0]
            run.event("select", index=run.best_index, score=run.scores[run.best_index])

        return guarded(ledger, body)
