"""Particle filtering (`metaloom.search.particle`) with a scripted generator and scripted step
scores: the weights and their resampling distribution, a golden run, the ESS trigger, and the
three places it departs from the reference code (Puri et al. 2025), each pinned: weights carried
when a round skips resampling, a particle drawn k times voting k times, and (for entropic
particle filtering) the ESS taken on the importance weights, not on the annealed ones."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.search import particle
from metaloom.search.entropic import EntropicParticleFiltering
from metaloom.search.particle import ParticleFiltering, ess, logit, resample, weights
from metaloom.testing.scripted import ScriptedStepScorer
from tests.test_search import Counting, by_text, tree_of

P = SamplingParams(temperature=0.8, max_tokens=64, seed=1)


def resamples(result: Any) -> list[dict[str, Any]]:
    return [e.data for e in result.trace if e.kind == "resample"]


def test_particle_weights_and_ess() -> None:
    # logit(0.5) = 0, logit(0.75) = ln 3: softmax -> 1/4, 3/4 (odds 1 : 3)
    assert weights([0.5, 0.75], 1.0) == pytest.approx([0.25, 0.75])
    assert weights([0.5, 0.75], 2.0) == pytest.approx([1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))])
    assert ess([0.25, 0.25, 0.25, 0.25]) == pytest.approx(4.0)
    assert ess([1.0, 0.0]) == pytest.approx(1.0)
    assert weights([1.0, 0.0], 1.0)[0] == pytest.approx(1.0)  # clamped, no division by zero


def test_particle_resampling_distribution() -> None:
    """Multinomial resampling draws index i with probability w_i: over 200 x 8 draws each
    count is within 5 standard deviations of its binomial mean (a wrong rule, e.g. uniform or
    keep-the-best, is far outside)."""
    w = weights([0.2, 0.5, 0.8, 0.95, 0.5, 0.6, 0.3, 0.7], 1.0)
    rng = random.Random(7)
    counts: Counter[int] = Counter()
    rounds_, n = 200, len(w)
    for _ in range(rounds_):
        counts.update(resample(w, rng))
    total = rounds_ * n
    for i, p in enumerate(w):
        sd = math.sqrt(total * p * (1 - p))
        assert abs(counts[i] - total * p) <= 5 * sd + 1, (i, counts[i], total * p)
    # the uniform rule would put index 3 (w = 0.43) near 1/8: far outside the bound above
    assert abs(total / n - total * w[3]) > 5 * math.sqrt(total * w[3] * (1 - w[3]))


def test_particle_filtering_golden_run() -> None:
    table = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1"], "Qb\n\n": ["b1", "b2"]}
    scores = {"a": 0.01, "b": 0.99, "a1": 0.5, "b1": 0.9, "b2": 0.8}
    gen = Counting(table)
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=2, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    resamples = [e for e in result.trace if e.kind == "resample"]
    # weights 0.01 : 0.99 -> odds 1/99 : 99, w_b = 0.9999: both draws pick b (seeded), a is pruned
    assert resamples and resamples[0].data["drawn"] == [nodes["b"]["id"]] * 2
    assert nodes["a"]["state"] == "pruned"
    # b is drawn twice: one request with n = 2
    assert gen.calls == [1, 1] and sorted(n["text"] for n in tree["nodes"] if n["parent"] == nodes["b"]["id"]) == ["b1", "b2"]
    assert result.best == "b\n\nb1"


def test_particle_filtering_ess_threshold_skips_resampling() -> None:
    table = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1"], "Qb\n\n": ["b1"]}
    scores = {"a": 0.5, "b": 0.55, "a1": 0.5, "b1": 0.5}
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=2, ess_threshold=0.5, params=P).run(
        "Q", Counting(table), ledger=Ledger())
    # ESS of nearly equal weights is about 2 >= 0.5 x 2: no resampling, both particles go on
    assert not [e for e in result.trace if e.kind == "resample"]
    assert sorted(c.text for c in result.candidates) == ["a\n\na1", "b\n\nb1"]


def test_particle_filtering_answers_from_the_final_population_only() -> None:
    """A particle that finished in round 0 and was not drawn at resampling is out of the
    population: no candidate, no vote (it used to stay a candidate and vote)."""
    from metaloom.score.answers import LastNumber

    table = {"Q": ["7", "b\n\n"], "Qb\n\n": ["5", "5"]}
    scores = {"7": 0.01, "b": 0.99, "5": 0.9}
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=2, params=P, select="vote",
                               extractor=LastNumber()).run("Q", Counting(table), ledger=Ledger())
    nodes = by_text(tree_of(result))
    assert nodes["7"]["finish"] is not None and nodes["7"]["state"] == "pruned"
    assert sorted(c.text for c in result.candidates) == ["b\n\n5", "b\n\n5"]
    assert "7" not in result.answers and result.best == "b\n\n5"


def test_particle_filtering_does_not_resample_equal_weights() -> None:
    """All particles scored alike: ESS = n, nothing to resample even at the default threshold (a
    rule that resampled anyway would duplicate and drop particles at random)."""
    table = {"Q": ["a\n\n", "b\n\n", "c\n\n"], "Qa\n\n": ["a1"], "Qb\n\n": ["b1"], "Qc\n\n": ["c1"]}
    scores = {"a": 0.6, "b": 0.6, "c": 0.6, "a1": 0.6, "b1": 0.6, "c1": 0.6}
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=3, params=P).run(
        "Q", Counting(table), ledger=Ledger())
    assert not [e for e in result.trace if e.kind == "resample"]
    assert sorted(c.text for c in result.candidates) == ["a\n\na1", "b\n\nb1", "c\n\nc1"]


# ---- departures from the reference code (issue 48)

# two particles that keep scoring 0.2 and 0.6 for three rounds
CARRY_TABLE = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1\n\n"], "Qb\n\n": ["b1\n\n"],
               "Qa\n\na1\n\n": ["a2"], "Qb\n\nb1\n\n": ["b2"]}
CARRY_SCORES = {"a": 0.2, "b": 0.6, "a1": 0.2, "b1": 0.6, "a2": 0.5, "b2": 0.5}


def test_weights_carry_over_a_round_that_skips_resampling() -> None:
    """ess_threshold 0.6 with n = 2: resample below ESS 1.2. Round 0: w = softmax(logit 0.2,
    logit 0.6) = (1/7, 6/7), ESS 1.32: no resampling. Round 1 scores the same, and the weights
    multiply: log-weights 2·logit, w = (1/37, 36/37), ESS 1.06 < 1.2: resample. Weights
    recomputed from the current scores alone (the old rule) stay at (1/7, 6/7) and never resample."""
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(CARRY_SCORES), n=2, ess_threshold=0.6,
                               params=P).run("Q", Counting(CARRY_TABLE), ledger=Ledger())
    nodes = by_text(tree_of(result))
    assert (nodes["a"]["weight"], nodes["b"]["weight"]) == pytest.approx((1 / 7, 6 / 7), abs=1e-6)
    assert (nodes["a1"]["weight"], nodes["b1"]["weight"]) == pytest.approx((1 / 37, 36 / 37), abs=1e-6)
    events = resamples(result)
    assert [e["step"] for e in events] == [1]
    assert events[0]["ess"] == pytest.approx(1 / ((1 / 37) ** 2 + (36 / 37) ** 2))
    # after the resampling the weights start equal again: round 2 (0.5, 0.5) gives equal weights
    survivors = [n for n in tree_of(result)["nodes"] if n["text"].strip() in ("a2", "b2")]
    assert survivors and all(n["weight"] == pytest.approx(1 / len(survivors), abs=1e-6) for n in survivors)


def test_at_the_default_threshold_the_carried_weights_are_the_reference_rule() -> None:
    """Resampling every round (the reference's and the default's rule) resets the weights each
    round, so the recorded weights are softmax(logit r) of that round's scores."""
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(CARRY_SCORES), n=2, params=P).run(
        "Q", Counting(CARRY_TABLE), ledger=Ledger())
    events = resamples(result)
    assert events and events[0]["step"] == 0
    for e in events:  # never the carried (1/37, 36/37)
        assert sorted(e["weights"]) == pytest.approx(weights([0.2, 0.6], 1.0))


def test_a_finished_particle_drawn_k_times_votes_k_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five particles; round 0 ends three solutions ("7", "5", "5") and the resampling (fixed
    here) draws the "7" particle three times and the two "5" particles once each. The reference
    keeps three copies of "7" in its final population: 7 wins 3 votes to 2. One vote per tree
    node (the old count) would have made it 1 to 2 for 5."""
    table = {"Q": ["7", "5", "5", "c\n\n", "d\n\n"]}
    scores = {"7": 0.5, "5": 0.6, "c": 0.1, "d": 0.1}
    monkeypatch.setattr(particle, "resample", lambda w, rng: [0, 0, 0, 1, 2])
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=5, params=P, select="vote",
                               extractor=LastNumber()).run("Q", Counting(table), ledger=Ledger())
    assert sorted(c.text for c in result.candidates) == ["5", "5", "7"]  # one candidate per node
    assert result.answer == "7" and result.best == "7"
    vote = next(e.data for e in result.trace if e.kind == "vote")
    assert vote["tally"] == {"7": 3.0, "5": 2.0}
    copies = {n["id"]: n.get("copies") for n in tree_of(result)["nodes"] if n["state"] == "finished"}
    assert sorted(copies.values()) == [1, 1, 3]


def test_weighted_votes_count_copies_too(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"Q": ["7", "5", "5", "c\n\n", "d\n\n"]}
    scores = {"7": 0.5, "5": 0.6, "c": 0.1, "d": 0.1}
    monkeypatch.setattr(particle, "resample", lambda w, rng: [0, 0, 0, 1, 2])
    result = ParticleFiltering(step_scorer=ScriptedStepScorer(scores), n=5, params=P, select="weighted_vote",
                               extractor=LastNumber()).run("Q", Counting(table), ledger=Ledger())
    vote = next(e.data for e in result.trace if e.kind == "vote")
    assert vote["tally"] == pytest.approx({"7": 3 * 0.5, "5": 2 * 0.6})  # 1.5 against 1.2
    assert result.answer == "7"


EPF_TABLE = {"Q": ["a\n\n", "b\n\n", "c\n\n", "d\n\n"], "Qa\n\n": ["a1"], "Qb\n\n": ["b1"],
             "Qc\n\n": ["c1"], "Qd\n\n": ["d1"]}
EPF_SCORES = {"a": 0.999, "b": 0.01, "c": 0.01, "d": 0.01, "a1": 0.5, "b1": 0.5, "c1": 0.5, "d1": 0.5}


def test_entropic_annealing_does_not_suppress_resampling() -> None:
    """The weights collapse onto "a" (ESS about 1, below ess_threshold 0.5 x 4 = 2); ePF
    anneals the draw back to 0.9 log 4 nats, whose ESS is above 2. The resampling still happens
    (the old rule took the ESS of the annealed weights and skipped it), drawing from the
    annealed distribution."""
    result = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(EPF_SCORES), n=4, params=P, ess_threshold=0.5,
                                       entropy_threshold=0.9, lookahead=0).run("Q", Counting(EPF_TABLE),
                                                                               ledger=Ledger())
    w = weights([0.999, 0.01, 0.01, 0.01], 1.0)
    events = resamples(result)
    assert [e["step"] for e in events] == [0]
    assert events[0]["ess"] == pytest.approx(ess(w)) and ess(w) < 2
    drawn_from = events[0]["drawn_from"]
    assert ess(drawn_from) > 2  # the annealed draw alone would not have triggered it
    assert -sum(v * math.log(v) for v in drawn_from) == pytest.approx(0.9 * math.log(4), abs=1e-9)
    nodes = by_text(tree_of(result))
    assert nodes["a"]["weight"] == pytest.approx(w[0], abs=1e-6)
    assert nodes["a"]["resampling_weight"] == pytest.approx(drawn_from[0], abs=1e-6)


def test_logit_is_clamped() -> None:
    assert logit(0.5) == 0.0 and math.isfinite(logit(0.0)) and math.isfinite(logit(1.0))
    assert logit(0.75) == pytest.approx(math.log(3))
