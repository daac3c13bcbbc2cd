"""Voting: self-consistency (majority vote over extracted answers, Wang et al. 2023) and
weighted voting (each sample's vote weighted by a scorer, answers marginalised — Li et al.
2023; Wu et al. 2024 show when it beats best-of-N: when v·g puts more mass on the right
answer than g alone)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, collect, component, default_sampling, ensure, guarded, positive, score
from metaloom.meta.types import Result, Strategy
from metaloom.meta.voting import decide
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor, MathAnswer
from metaloom.score.protocols import Prompt, Scorer, as_chat

TRANSFORMS = ("identity", "exp")


@dataclass(frozen=True)
class MajorityVote:
    """Self-consistency: the most common extracted answer among N samples wins.

    ``n`` samples, each votes for its extracted answer; the most common answer wins (ties:
    the answer seen first) and its first sample is the chosen output."""

    n: int = 8
    extractor: Extractor = field(default_factory=MathAnswer)
    params: SamplingParams = field(default_factory=default_sampling)
    inner: Strategy | None = None

    def __post_init__(self) -> None:
        positive("n", self.n)
        component("extractor", self.extractor, Extractor, "an Extractor instance (votes need answers)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("inner", self.inner, Strategy, "None or a Strategy instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            candidates = collect(run, generator, prompt, self.params, self.n, self.extractor, inner=self.inner)
            decide(run, run.answers, [1.0] * len(candidates), self.extractor)

        # on a budget stop, vote over what the samples said before it
        return guarded(ledger, body, lambda run: decide(run, run.answers, [1.0] * len(run.candidates), self.extractor))


@dataclass(frozen=True)
class WeightedVote:
    """Voting where each sample's vote weighs its score (answers marginalised).

    Like majority vote, but each sample's vote weighs its score: ``identity`` (scores must
    be >= 0, e.g. probabilities from a reward model or judge) or ``exp`` (for log-scores, e.g.
    sequence log-probabilities: the vote becomes the answers' total probability). The chosen
    output is the best-scored sample of the winning answer."""

    scorer: Scorer
    n: int = 8
    extractor: Extractor = field(default_factory=MathAnswer)
    transform: str = "identity"
    params: SamplingParams = field(default_factory=default_sampling)
    inner: Strategy | None = None

    def __post_init__(self) -> None:
        component("scorer", self.scorer, Scorer, "a Scorer instance (a name and a score method)")
        positive("n", self.n)
        component("extractor", self.extractor, Extractor, "an Extractor instance (votes need answers)")
        ensure(self.transform in TRANSFORMS, "transform", self.transform, f"one of {TRANSFORMS}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("inner", self.inner, Strategy, "None or a Strategy instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            candidates = collect(run, generator, prompt, self.params, self.n, self.extractor, inner=self.inner)
            run.scores.extend(score(run, self.scorer, prompt, candidates))
            if self.transform == "exp":
                top = max(run.scores)  # shift before exp: same ranking, no underflow to all-zero
                weights = [math.exp(s - top) if math.isfinite(top) else 0.0 for s in run.scores]
            else:
                if any(s < 0 for s in run.scores):
                    raise InvalidParameter("transform", self.transform,
                                           f"'exp' for scorer {self.scorer.name!r}, whose scores are negative")
                weights = list(run.scores)
            decide(run, run.answers, weights, self.extractor)

        return guarded(ledger, body)
