"""Particle filtering over reasoning steps (Puri et al. 2025, "A Probabilistic Inference
Approach to Inference-Time Scaling of LLMs using Particle-Based Monte Carlo Methods").

The model is the transition kernel and the step scorer the emission: ``n`` particles each
take one step per round; each round a particle's weight is multiplied by the emission of its
partial solution, whose score r (by default its last step's, the paper's choice) enters as the
logit: the incremental log-weight is logit(r) / ``temperature``, so at temperature 1 a particle
is resampled in proportion to the odds r / (1 - r), as in the paper's implementation. The
effective sample size ESS = 1 / Σ w_i² of the normalised weights decides when to resample (the
standard SMC trigger, Doucet & Johansen 2009): below ``ess_threshold · n`` the particles are
resampled multinomially (the paper's rule), the ones not drawn are pruned and the weights start
afresh (equal). The paper resamples at every step; ``ess_threshold = 1`` (the default) does
too, except when the weights are all equal. A finished particle stays in the population (it can
be drawn again, never expanded) until a resampling does not draw it; the search ends when every
particle has finished, and the answer is chosen from the final population only (a finished
particle that was dropped is no candidate and casts no vote). Draws come from ``params.seed``
(reproducible when seeded).

Where this differs from the reference code (probabilistic-inference-scaling's
``particle_gibbs.py`` and its successor, its_hub's ``ParticleFiltering``), and why:

- **Weights carry when resampling is skipped.** The reference resamples every round, so each
  round's weight is just that round's emission. With ``ess_threshold < 1`` a round may skip
  resampling; the particles then keep their accumulated weight and the new emission multiplies
  it (log-weights add), as sequential importance sampling requires: recomputing the weights from
  the current scores alone would forget the earlier rounds' evidence. After a resampling the
  weights are equal again, so at the default threshold this is the reference's rule exactly.
  A finished particle's emission each round is its final score's, as the reference (with
  ``resample_inactive``) re-weighs its finished particles every round.
- **A particle drawn k times counts k times.** The reference deep-copies each draw, so a
  finished particle drawn k times is k members of the final population. Here the copies share
  one tree node (one candidate in the result), and under ``select="vote"`` or
  ``"weighted_vote"`` that candidate casts k votes (the node's ``copies`` in the trace).
- **ESS is the importance weights'.** A variant may resample from a different distribution than
  the weights (entropic particle filtering's annealing, `metaloom.search.entropic`); the ESS that
  triggers resampling is always computed on the importance weights, so flattening the draw
  never suppresses a resampling the weights call for.

Each particle's node records its normalised ``weight`` and, where the draw used another
distribution, its ``resampling_weight``; each resampling is a "resample" trace event.
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


def logit(r: float) -> float:
    """log(r / (1 - r)) with r clamped into [EPS, 1 - EPS] (a score of 0 or 1 stays finite)."""
    r = min(max(r, EPS), 1.0 - EPS)
    return math.log(r / (1.0 - r))


def normalise(logw: Sequence[float], temperature: float = 1.0) -> list[float]:
    """w_i = exp(ℓ_i / T) / Σ_j exp(ℓ_j / T) (T: ``temperature``; T = inf gives uniform weights)."""
    if math.isinf(temperature):
        return [1.0 / len(logw)] * len(logw)
    scaled = [v / temperature for v in logw]
    top = max(scaled)
    e = [math.exp(v - top) for v in scaled]
    total = sum(e)
    return [v / total for v in e]


def weights(scores: Sequence[float], temperature: float) -> list[float]:
    """Normalised particle weights after one round from equal weights: softmax(logit(r) / temperature)."""
    return normalise([logit(r) / temperature for r in scores])


def ess(w: Sequence[float]) -> float:
    """Effective sample size of normalised weights."""
    return 1.0 / sum(v * v for v in w)


def resample(w: Sequence[float], rng: random.Random) -> list[int]:
    """Multinomial resampling: ``len(w)`` indices drawn with probabilities ``w``."""
    return rng.choices(range(len(w)), weights=w, k=len(w))


@dataclass(frozen=True)
class ParticleFiltering(SearchConfig):
    """Particle filtering (Puri et al. 2025): ``n`` particles, weight temperature ``temperature``,
    resampling below ``ess_threshold · n`` effective samples (weights carried between
    resamplings; the module docstring lists where it departs from the reference code)."""

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

    # the three hooks a variant overrides (`metaloom.search.entropic`): how a round grows the
    # particles, this round's log-weights, and the distribution a resampling draws from
    def advance(self, s: Search, parents: list[Node], widths: list[int]) -> list[Node]:
        """One round: ``parents[i]`` grows ``widths[i]`` children, scored."""
        return s.step(parents, widths)

    def log_weights(self, s: Search, particles: list[Node], step: int) -> list[float]:
        """This round's incremental log-weights (the emission): logit(r) / ``temperature``."""
        return [logit(p.score or 0.0) / self.temperature for p in particles]

    def resampling_weights(self, s: Search, logw: list[float], step: int) -> list[float]:
        """The distribution a resampling draws from, given the accumulated log-weights: the
        normalised weights themselves."""
        return normalise(logw)

    def search(self, s: Search) -> None:
        rng = random.Random(self.params.seed)
        particles: list[Node] = self.advance(s, [s.tree.root], [self.n])
        carried = [0.0] * len(particles)  # log-weights accumulated since the last resampling
        step = 0
        while True:
            logw = [c + v for c, v in zip(carried, self.log_weights(s, particles, step), strict=True)]
            w = normalise(logw)
            draw = self.resampling_weights(s, logw, step)
            size = ess(w)  # of the importance weights, never of the distribution drawn from
            other = draw != w  # a variant draws from another distribution than the weights
            for p, v, d in zip(particles, w, draw, strict=True):
                p.extra["weight"] = round(v, 6)
                if other:
                    p.extra["resampling_weight"] = round(d, 6)
            carried = logw
            if size < self.ess_threshold * self.n - 1e-9:
                chosen = [particles[i] for i in resample(draw, rng)]
                s.tree.prune([p for p in particles if p not in chosen], finished_too=True)
                s.run.event("resample", step=step, ess=size, weights=w, drawn=[p.id for p in chosen],
                            **({"drawn_from": draw} if other else {}))
                particles, carried = chosen, [0.0] * len(chosen)
            s.copies = dict(Counter(p.id for p in particles))  # a finished particle drawn k times votes k times
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
