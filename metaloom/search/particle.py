"""Particle filtering over reasoning steps (Puri et al. 2025, "A Probabilistic Inference
Approach to Inference-Time Scaling of LLMs using Particle-Based Monte Carlo Methods").

The model is the transition kernel and the step scorer the emission: ``n`` particles each
take one step per round; each particle's weight comes from the score r of its partial
solution (by default its last step's, the paper's choice) as the logit, log w = logit(r) /
``temperature``, normalised by a softmax across particles — so a particle is resampled in
proportion to the odds r / (1 - r) at temperature 1, as in the paper's implementation. The
effective sample size ESS = 1 / Σ w_i² decides when to resample (the standard SMC trigger,
Doucet & Johansen 2009): below ``ess_threshold · n`` the particles are resampled
multinomially (the paper's rule) and the ones not drawn are pruned. The paper resamples at
every step; ``ess_threshold = 1`` (the default) does too, except when the weights are all
equal. A finished particle stays in the population (it can be drawn again, never
expanded) until a resampling does not draw it; the search ends when every particle has
finished, and the answer is chosen from the final population only (a finished particle that
was dropped is no candidate and casts no vote). Draws come from
``params.seed`` (reproducible when seeded).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import fraction, positive
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.core import Search, SearchConfig, run_search
from metaloom.search.tree import Node

EPS = 1e-6  # scores are clamped into [EPS, 1 - EPS] before the logit


def weights(scores: Sequence[float], temperature: float) -> list[float]:
    """Normalised particle weights: softmax(logit(r) / temperature)."""
    logits = []
    for r in scores:
        r = min(max(r, EPS), 1.0 - EPS)
        logits.append(math.log(r / (1.0 - r)) / temperature)
    top = max(logits)
    e = [math.exp(v - top) for v in logits]
    total = sum(e)
    return [v / total for v in e]


def ess(w: Sequence[float]) -> float:
    """Effective sample size of normalised weights."""
    return 1.0 / sum(v * v for v in w)


def resample(w: Sequence[float], rng: random.Random) -> list[int]:
    """Multinomial resampling: ``len(w)`` indices drawn with probabilities ``w``."""
    return rng.choices(range(len(w)), weights=w, k=len(w))


@dataclass(frozen=True)
class ParticleFiltering(SearchConfig):
    """Particle filtering (Puri et al. 2025): ``n`` particles, weight temperature ``temperature``,
    resampling below ``ess_threshold · n`` effective samples."""

    n: int = 8
    temperature: float = 1.0
    ess_threshold: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("n", self.n)
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise InvalidParameter("temperature", self.temperature, "a number > 0")
        fraction("ess_threshold", self.ess_threshold, closed_low=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "particle_filtering", prompt, generator, ledger, self.search)

    # the two hooks a variant overrides (`metaloom.search.entropic`): how a round grows the
    # particles, and the weights they are resampled with
    def advance(self, s: Search, parents: list[Node], widths: list[int]) -> list[Node]:
        """One round: ``parents[i]`` grows ``widths[i]`` children, scored."""
        return s.step(parents, widths)

    def resampling_weights(self, s: Search, particles: list[Node], step: int) -> list[float]:
        """The normalised weights the particles are resampled with (``step``: the round)."""
        return weights([p.score or 0.0 for p in particles], self.temperature)

    def search(self, s: Search) -> None:
        rng = random.Random(self.params.seed)
        particles: list[Node] = self.advance(s, [s.tree.root], [self.n])
        step = 0
        while True:
            w = self.resampling_weights(s, particles, step)
            size = ess(w)
            for p, v in zip(particles, w, strict=True):
                p.extra["weight"] = round(v, 6)
            if size < self.ess_threshold * self.n - 1e-9:
                drawn = resample(w, rng)
                chosen = [particles[i] for i in drawn]
                s.tree.prune([p for p in particles if p not in chosen], finished_too=True)
                s.run.event("resample", step=step, ess=size, weights=w, drawn=[p.id for p in chosen])
                particles = chosen
            live = [p for p in particles if not p.finished]
            if not live:
                s.stop = "finished"
                return
            counts = Counter(p.id for p in live)
            parents = [s.tree.nodes[i] for i in counts]
            children = self.advance(s, parents, [counts[p.id] for p in parents])
            it = iter(children)
            grown = {p.id: [next(it) for _ in range(counts[p.id])] for p in parents}
            particles = [p if p.finished else grown[p.id].pop(0) for p in particles]
            step += 1
