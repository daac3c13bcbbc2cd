"""Adaptive self-consistency: sample in rounds and stop voting once the leading answer is
clear enough, spending samples only on questions that need them (Aggarwal et al. 2023,
"Let's Sample Step by Step: Adaptive-Consistency"; Li et al. 2024, Early-Stopping
Self-Consistency).

Stopping rules, all over the answer counts so far (uniform prior, exact integer formulas —
for integer a, b: P(Beta(a, b) > 1/2) = P(Binomial(a+b-1, 1/2) <= a-1)):

- ``share``: the leader's share of all samples drawn >= threshold;
- ``beta``: P(the leader's true share > 1/2) under Beta(1 + c_lead, 1 + c_rest) >= threshold;
- ``dirichlet``: P(the leader's probability > the runner-up's) under the Dirichlet posterior
  >= threshold; marginally p_lead / (p_lead + p_second) ~ Beta(1 + c_lead, 1 + c_second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, collect, component, default_sampling, ensure, fraction, guarded, positive
from metaloom.meta.types import Result
from metaloom.meta.voting import decide
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor, MathAnswer
from metaloom.score.protocols import Prompt, as_chat

RULES = ("share", "beta", "dirichlet")


def beta_above_half(a: int, b: int) -> float:
    """P(X > 1/2) for X ~ Beta(a, b), integers a, b >= 1."""
    n = a + b - 1
    return sum(math.comb(n, k) for k in range(a)) / 2**n


def confidence(rule: str, counts: list[float], drawn: int) -> float:
    """How sure the vote is of its leader, under ``rule``; ``counts`` sorted descending."""
    lead = int(counts[0]) if counts else 0
    if rule == "share":
        return lead / drawn if drawn else 0.0
    if rule == "beta":
        return beta_above_half(1 + lead, 1 + drawn - lead)
    second = int(counts[1]) if len(counts) > 1 else 0
    return beta_above_half(1 + lead, 1 + second)


@dataclass(frozen=True)
class AdaptiveVote:
    """Self-consistency that stops sampling once the vote is clear.

    Rounds of ``batch`` samples (one request each) up to ``max_samples``; after at least
    ``min_samples``, stop when ``confidence(rule) >= threshold``. The trace reports the
    samples drawn and those saved against ``max_samples``."""

    batch: int = 4
    max_samples: int = 16
    min_samples: int = 4
    rule: str = "dirichlet"
    threshold: float = 0.95
    extractor: Extractor = field(default_factory=MathAnswer)
    params: SamplingParams = field(default_factory=default_sampling)

    def __post_init__(self) -> None:
        positive("batch", self.batch)
        positive("max_samples", self.max_samples)
        low = self.min_samples
        ensure(isinstance(low, int) and not isinstance(low, bool) and 0 <= low <= self.max_samples, "min_samples", low,
               f"an integer in [0, max_samples={self.max_samples}]")
        ensure(self.rule in RULES, "rule", self.rule, f"one of {RULES}")
        ensure(not isinstance(self.threshold, bool), "threshold", self.threshold, "(0, 1]")
        fraction("threshold", self.threshold)
        component("extractor", self.extractor, Extractor, "an Extractor instance (votes need answers)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            r, sure = 0, 0.0
            while len(run.candidates) < self.max_samples:
                k = min(self.batch, self.max_samples - len(run.candidates))
                collect(run, generator, prompt, self.params, k, self.extractor, round=r)
                t = decide(run, run.answers, [1.0] * len(run.candidates), self.extractor)
                drawn = len(run.candidates)
                sure = confidence(self.rule, [t.weights[c] for c in t.order], drawn)
                run.event("round", round=r, drawn=drawn, confidence=sure)
                r += 1
                if drawn >= self.min_samples and sure >= self.threshold:
                    break
            run.event("adaptive", samples=len(run.candidates), saved=self.max_samples - len(run.candidates),
                      confidence=sure, rule=self.rule)

        # on a budget stop, vote over what the samples said before it
        return guarded(ledger, body, lambda run: decide(run, run.answers, [1.0] * len(run.candidates), self.extractor))
