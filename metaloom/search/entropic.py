"""Entropic particle filtering (ePF): particle filtering (`metaloom.search.particle`) with
Entropic Annealing and Look-ahead Modulation, after "Mitigating Premature Exploitation in
Particle-based Monte Carlo for Inference-Time Scaling" (2025).

A process reward model scores early steps overconfidently, so plain particle filtering
resamples almost every particle from one lineage (particle impoverishment) and commits to it.
ePF keeps the particle filter and changes the distribution it resamples from:

1. **Entropic Annealing (EA).** The particles' log-weights are those of particle filtering,
   ℓ_i = logit(r_i) / τ (r_i: the particle's score, τ: ``temperature``), and their normalised
   weights w_i(T) = exp(ℓ_i / T) / Σ_j exp(ℓ_j / T) at annealing temperature T (T = 1: plain
   particle filtering). Their diversity is the Shannon entropy H(w) = -Σ_i w_i log w_i, at most
   log N for N particles (all weights equal). With the target H* = θ · log N (θ:
   ``entropy_threshold``): when H(w(1)) ≥ H* nothing changes (T = 1); when it falls below, the
   resampling distribution is flattened with the one T > 1 for which H(w(T)) = H* exactly. H(w(T))
   increases strictly with T wherever the ℓ_i differ (with β = 1/T, dH/dβ = -β Var_w(ℓ) < 0) and
   tends to log N > H* as T → ∞, so the root is unique; it is found by bisection on β ∈ (0, 1]
   (`annealing_temperature`). Annealing keeps the weights' order (the better particle is still
   drawn more often) and only as much flatter as the target asks.
2. **Look-ahead Modulation (LaM).** A particle's weight also asks where it leads: with
   ``lookahead = d ≥ 1`` each new open particle is rolled out ``d`` more steps greedily
   (temperature 0, stopping where the solution ends, outside the tree, as in
   `metaloom.search.lookahead`) and the step scorer scores the rollout's end, r̂_i (aggregated
   with the path's step scores by ``aggregation``). The particle resamples with the modulated
   score r'_i, whose odds are the geometric mean of the state's and its successor's:
       logit(r'_i) = (logit(r_i) + logit(r̂_i)) / 2,   i.e.  odds(r'_i) = sqrt(odds(r_i) · odds(r̂_i)).
   A particle with no successor (finished, or cut by a budget) is its own: r̂_i = r_i, r'_i = r_i.
   The modulated score weights resampling only; the node keeps its own score for the answer.

The annealing shapes only the distribution a resampling draws from: whether to resample is
decided by the effective sample size of the particles' own (importance) weights, as in particle
filtering (`metaloom.search.particle`), since an ESS taken on the annealed weights would let the
flattening suppress the very resampling the weights call for. Weights accumulate between
resamplings as there; the annealing applies to the accumulated log-weights.

The abstract does not give the rules' exact form; these are the simplest faithful ones (the
choices: the target entropy equals the trigger threshold, the annealing is a temperature on
the log-weights found exactly, the look-ahead is greedy and combined by the geometric mean of
the odds). Per round: one generator call for the particles' steps, ``d`` more for the
rollouts, one step-scorer call for both (and the final scorer's, where solutions finish).
Each round's "entropy" event records the entropy before and after annealing, the target and
the temperature used; each particle's node records its ``weight`` (the importance weight), its
``resampling_weight`` when annealed and, with a look-ahead, its ``lookahead_score`` and
``modulated_score``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.aggregate import aggregate
from metaloom.search.core import Search, run_search
from metaloom.search.lookahead import roll_ahead
from metaloom.search.particle import ParticleFiltering, logit, normalise
from metaloom.search.tree import Node

__all__ = ["EntropicParticleFiltering", "annealing_temperature", "entropy", "log_weights", "logit", "modulate",
           "normalise"]

BISECTION_STEPS = 200  # halvings of β's interval: far below float precision long before


def log_weights(scores: Sequence[float], temperature: float = 1.0) -> list[float]:
    """Particle filtering's log-weights ℓ_i = logit(r_i) / ``temperature``."""
    return [logit(r) / temperature for r in scores]


def entropy(w: Sequence[float]) -> float:
    """Shannon entropy -Σ w_i log w_i of normalised weights (0 log 0 = 0), in nats."""
    return -sum(v * math.log(v) for v in w if v > 0.0)


def annealing_temperature(logw: Sequence[float], target: float) -> float:
    """The annealing temperature T ≥ 1 of Entropic Annealing: 1 when H(normalise(ℓ)) is at
    least ``target``; else the unique T > 1 with H(normalise(ℓ, T)) = ``target``, found by
    bisection on β = 1/T ∈ (0, 1] (H falls strictly as β grows). ``target`` must lie in
    [0, log N); a target the weights cannot reach is `InvalidParameter`."""
    n = len(logw)
    if n == 0:
        raise InvalidParameter("log_weights", list(logw), "at least one particle")
    if n == 1 and target == 0.0:
        return 1.0  # one particle: entropy 0 at every temperature
    if not 0.0 <= target < math.log(n):
        raise InvalidParameter("target", target, f"an entropy in [0, log N) = [0, {math.log(n):.6g})")
    if entropy(normalise(logw)) >= target:
        return 1.0
    lo, hi = 0.0, 1.0  # H(lo) = log N > target > H(hi)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if entropy(normalise(logw, 1.0 / mid)) > target:
            lo = mid
        else:
            hi = mid
    return 1.0 / (0.5 * (lo + hi))


def modulate(scores: Sequence[float], lookahead_scores: Sequence[float]) -> list[float]:
    """Look-ahead Modulation: r'_i with logit(r'_i) = (logit(r_i) + logit(r̂_i)) / 2 — the
    geometric mean of the odds of a state and of its look-ahead successor."""
    if len(scores) != len(lookahead_scores):
        raise InvalidParameter("lookahead_scores", list(lookahead_scores), f"one per score ({len(scores)})")
    return [1.0 / (1.0 + math.exp(-0.5 * (logit(r) + logit(q)))) for r, q in zip(scores, lookahead_scores, strict=True)]


@dataclass(frozen=True)
class EntropicParticleFiltering(ParticleFiltering):
    """Entropic particle filtering: particle filtering (``n`` particles, weight temperature
    ``temperature``, resampling below ``ess_threshold · n`` effective samples) whose resampling
    distribution is annealed back to entropy ``entropy_threshold · log n`` whenever it falls
    below it, and whose weights are modulated by a ``lookahead``-step greedy rollout of each
    particle (0: no look-ahead)."""

    entropy_threshold: float = 0.5
    lookahead: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        t = self.entropy_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < 1.0:
            raise InvalidParameter("entropy_threshold", t, "a fraction of the maximum entropy log n in [0, 1)")
        if not isinstance(self.lookahead, int) or isinstance(self.lookahead, bool) or self.lookahead < 0:
            raise InvalidParameter("lookahead", self.lookahead, "an integer >= 0 (steps to look ahead; 0: none)")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "entropic_particle_filtering", prompt, generator, ledger, self.search)

    def advance(self, s: Search, parents: list[Node], widths: list[int]) -> list[Node]:
        if self.lookahead == 0:
            return s.step(parents, widths)
        s.begin_round(parents)
        children = s.expand(parents, widths)
        tails = roll_ahead(s, children, self.lookahead, self.delimiter)
        scored = [c for c in children if c.finish != "budget"]
        ahead = [c for c in scored if tails[c.id]]
        # one scorer call: each new step, then each rollout's end
        values = s.last_scores([s.tree.texts(c) for c in scored]
                               + [s.tree.texts(c) + [t.text for t in tails[c.id]] for c in ahead]) if scored else []
        for c, v in zip(scored, values[:len(scored)], strict=True):
            c.step_score = v
        s.rescore(scored)
        for c, v in zip(ahead, values[len(scored):], strict=True):
            c.extra["lookahead"] = "".join(t.text for t in tails[c.id])
            c.extra["lookahead_tokens"] = sum(len(t.token_ids) for t in tails[c.id])
            c.extra["lookahead_score"] = aggregate(self.aggregation, [*s.tree.step_scores(c), v])
        s.score_finished(children)
        s.end_round()
        return children

    def log_weights(self, s: Search, particles: list[Node], step: int) -> list[float]:
        """The round's log-weights from the look-ahead-modulated scores."""
        scores = [p.score or 0.0 for p in particles]
        if self.lookahead:
            scores = modulate(scores, [p.extra.get("lookahead_score", r) for p, r in zip(particles, scores, strict=True)])
            for p, r in zip(particles, scores, strict=True):
                if "lookahead_score" in p.extra:
                    p.extra["modulated_score"] = round(r, 6)
        return log_weights(scores, self.temperature)

    def resampling_weights(self, s: Search, logw: list[float], step: int) -> list[float]:
        """The weights annealed back to the target entropy where they fell below it."""
        before = normalise(logw)
        target = self.entropy_threshold * math.log(len(logw))
        t = annealing_temperature(logw, target)
        w = normalise(logw, t)
        s.run.event("entropy", step=step, before=entropy(before), after=entropy(w), target=target,
                    max=math.log(len(logw)), temperature=t, annealed=t > 1.0)
        return w
