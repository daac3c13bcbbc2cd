"""Entropic particle filtering (`metaloom.search.entropic`): the maths on hand-made weights
(entropy, the annealing temperature that restores the target entropy exactly, look-ahead
modulation), then the strategy with a scripted generator and scripted step scores: an
overconfident scorer collapses plain particle filtering to one lineage while ePF keeps several,
the look-ahead's weights and charges, budget stops, bad input."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from metaloom.errors import InvalidParameter
from metaloom.ledger import Budget, Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.search.entropic import (
    EntropicParticleFiltering,
    annealing_temperature,
    entropy,
    log_weights,
    modulate,
    normalise,
)
from metaloom.search.particle import ParticleFiltering, weights
from metaloom.testing.scripted import ScriptedGenerator, ScriptedStepScorer
from metaloom.wiring.configure import build_strategy
from tests.test_search import Counting

P = SamplingParams(temperature=0.8, max_tokens=64, seed=1)


def tree_of(result: Any) -> dict[str, Any]:
    trees = [e for e in result.trace if e.kind == "tree"]
    assert len(trees) == 1
    return trees[0].data


def by_text(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["text"].strip(): n for n in tree["nodes"] if n["parent"] is not None}


def lineages(result: Any) -> list[str]:
    """The first step (the root's child) each candidate of the final population descends from."""
    return [c.text.split("\n\n")[0] for c in result.candidates]


def binary_entropy(p: float) -> float:
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


# ------------------------------------------------------------------------------- the maths


def test_entropy_of_hand_made_weights() -> None:
    for n in range(1, 7):
        assert entropy([1 / n] * n) == pytest.approx(math.log(n), abs=1e-15)  # the maximum, log N
    assert entropy([1.0, 0.0, 0.0]) == 0.0  # 0 log 0 = 0: one particle holds all the weight
    assert entropy([0.5, 0.25, 0.25]) == pytest.approx(1.5 * math.log(2), abs=1e-15)


def test_normalised_weights_are_particle_filterings_at_temperature_one() -> None:
    # logit(0.5) = 0, logit(0.75) = ln 3: w = 1/4, 3/4
    assert log_weights([0.5, 0.75]) == pytest.approx([0.0, math.log(3)], abs=1e-12)
    assert normalise(log_weights([0.5, 0.75])) == pytest.approx([0.25, 0.75], abs=1e-15)
    scores = [0.2, 0.5, 0.8, 0.95]
    assert normalise(log_weights(scores, 2.0)) == pytest.approx(weights(scores, 2.0), abs=1e-15)
    # annealing at T divides the log-weights by T: ln 9 / 2 = ln 3
    assert normalise([0.0, math.log(9)], 2.0) == pytest.approx([0.25, 0.75], abs=1e-15)
    assert normalise([0.0, 5.0, 9.0], math.inf) == [1 / 3] * 3


def test_the_annealing_temperature_restores_exactly_the_target_entropy() -> None:
    # two particles, log-weights 0 and ln 8 (w = 1/9, 8/9, entropy h(1/9) = 0.349 nats); the target
    # h(1/3) is reached where σ(ln 8 / T) = 2/3, i.e. ln 8 / T = ln 2: T = 3 exactly
    logw = [0.0, math.log(8)]
    assert entropy(normalise(logw)) == pytest.approx(binary_entropy(1 / 9), abs=1e-15)
    t = annealing_temperature(logw, binary_entropy(1 / 3))
    assert t == pytest.approx(3.0, abs=1e-9)
    assert normalise(logw, t) == pytest.approx([1 / 3, 2 / 3], abs=1e-9)
    # any target below log N, any weights: the entropy after annealing is the target
    logw = log_weights([0.999, 0.5, 0.3, 0.01, 0.6])
    for frac in (0.3, 0.6, 0.9, 0.99):
        target = frac * math.log(5)
        t = annealing_temperature(logw, target)
        assert t > 1.0 and entropy(normalise(logw, t)) == pytest.approx(target, abs=1e-12)


def test_the_annealing_temperature_grows_with_the_target() -> None:
    logw = log_weights([0.999, 0.5, 0.3, 0.01])
    temps = [annealing_temperature(logw, f * math.log(4)) for f in (0.5, 0.7, 0.9, 0.99)]
    assert temps == sorted(temps) and len(set(temps)) == 4


def test_no_annealing_when_the_entropy_is_at_or_above_the_threshold() -> None:
    logw = [0.0, math.log(3)]  # w = 1/4, 3/4: entropy 0.562 nats
    h = entropy(normalise(logw))
    assert annealing_temperature(logw, h - 1e-9) == 1.0
    assert annealing_temperature(logw, 0.0) == 1.0
    assert annealing_temperature(logw, h) == 1.0  # exactly at it: nothing to restore
    assert annealing_temperature([0.0, 0.0, 0.0], 0.99 * math.log(3)) == 1.0  # uniform: the maximum
    assert annealing_temperature([2.5], 0.0) == 1.0  # one particle: entropy 0 at every temperature


def test_an_unreachable_target_is_refused() -> None:
    with pytest.raises(InvalidParameter, match="target"):
        annealing_temperature([0.0, 1.0], math.log(2))  # log N is reached only as T -> infinity
    with pytest.raises(InvalidParameter, match="target"):
        annealing_temperature([0.0, 1.0], -0.1)
    with pytest.raises(InvalidParameter, match="log_weights"):
        annealing_temperature([], 0.0)


def test_look_ahead_modulation_on_hand_made_scores() -> None:
    # logit(r') = (logit r + logit r̂) / 2: odds 1 and 9 -> odds 3 -> 0.75; odds 9 and 1/9 -> 1 -> 0.5
    assert modulate([0.5, 0.9, 0.3], [0.9, 0.1, 0.3]) == pytest.approx([0.75, 0.5, 0.3], abs=1e-12)
    # a state whose successor scores alike is not moved; order follows the successor otherwise
    assert modulate([0.8, 0.8], [0.2, 0.95]) == pytest.approx([0.5, 1 / (1 + math.sqrt(1 / 76))], abs=1e-12)
    with pytest.raises(InvalidParameter, match="lookahead_scores"):
        modulate([0.5, 0.5], [0.5])


# ---------------------------------------------------------------------------- the strategy

# Q: four first steps; the scorer is sure of "a" (0.999) and lukewarm about the rest (0.5); every
# later step scores 0.5, so only the first resampling discriminates. Each step has four
# continuations, then an answer (no blank line: the solution ends).
LETTERS = "abcd"
OVER_TABLE: dict[str, list[str]] = {"Q": [f"{x}\n\n" for x in LETTERS]}
OVER_SCORES: dict[str, float] = {"a": 0.999, "b": 0.5, "c": 0.5, "d": 0.5}
for _x in LETTERS:
    OVER_TABLE[f"Q{_x}\n\n"] = [f"{_x}{i}\n\n" for i in range(1, 5)]
    for _i in range(1, 5):
        OVER_TABLE[f"Q{_x}\n\n{_x}{_i}\n\n"] = [f"{_x}{_i}z"]
        OVER_SCORES |= {f"{_x}{_i}": 0.5, f"{_x}{_i}z": 0.5}


def test_an_overconfident_scorer_collapses_particle_filtering_but_not_epf() -> None:
    """Seeded runs, lineages counted exactly: plain particle filtering draws "a" four times (w_a =
    999 / 1002) and ends with one lineage; ePF anneals the first resampling back to 0.9 log 4 nats
    (temperature 6.40) and its final population descends from three first steps."""
    plain = ParticleFiltering(step_scorer=ScriptedStepScorer(OVER_SCORES), n=4, params=P).run(
        "Q", ScriptedGenerator(OVER_TABLE), ledger=Ledger())
    assert lineages(plain) == ["a"] * 4
    epf = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(OVER_SCORES), n=4, params=P,
                                    entropy_threshold=0.9, lookahead=0).run("Q", ScriptedGenerator(OVER_TABLE),
                                                                            ledger=Ledger())
    assert sorted(lineages(epf)) == ["a", "a", "c", "d"] and len(set(lineages(epf))) == 3
    # the trace: per resampling step the entropy before and after annealing, and the temperature
    steps = [e.data for e in epf.trace if e.kind == "entropy"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    first = steps[0]
    assert first["before"] == pytest.approx(entropy(weights([0.999, 0.5, 0.5, 0.5], 1.0)), abs=1e-12)
    assert first["before"] < 0.9 * math.log(4) and first["annealed"] is True
    assert first["after"] == pytest.approx(0.9 * math.log(4), abs=1e-12) == first["target"]
    assert first["temperature"] == pytest.approx(6.3983, abs=1e-4)
    assert first["max"] == pytest.approx(math.log(4))
    # later rounds: equal scores, maximum entropy, no annealing
    assert all(s["temperature"] == 1.0 and not s["annealed"] and s["before"] == s["after"] for s in steps[1:])
    nodes = by_text(tree_of(epf))
    # a's importance weight is particle filtering's; the annealed one is what it was drawn with
    assert nodes["a"]["weight"] == pytest.approx(weights([0.999, 0.5, 0.5, 0.5], 1.0)[0], abs=1e-6)
    assert nodes["a"]["resampling_weight"] == pytest.approx(
        normalise(log_weights([0.999, 0.5, 0.5, 0.5]), first["temperature"])[0], abs=1e-6)
    json.dumps(epf.to_dict())  # the trace is plain JSON


def test_a_zero_threshold_is_plain_particle_filtering() -> None:
    plain = ParticleFiltering(step_scorer=ScriptedStepScorer(OVER_SCORES), n=4, params=P).run(
        "Q", ScriptedGenerator(OVER_TABLE), ledger=Ledger())
    epf = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(OVER_SCORES), n=4, params=P,
                                    entropy_threshold=0.0, lookahead=0).run("Q", ScriptedGenerator(OVER_TABLE),
                                                                            ledger=Ledger())
    assert [c.text for c in epf.candidates] == [c.text for c in plain.candidates]
    assert epf.usage == plain.usage
    assert all(e.data["temperature"] == 1.0 for e in epf.trace if e.kind == "entropy")


# "a" looks better than "b" (0.9 against 0.5) but leads to a poor step (0.1); "b" leads to a good one
LA_TABLE = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1\n\n"], "Qb\n\n": ["b1\n\n"],
            "Qa\n\na1\n\n": ["a2"], "Qb\n\nb1\n\n": ["b2"]}
LA_SCORES = {"a": 0.9, "b": 0.5, "a1": 0.1, "b1": 0.9, "a2": 0.5, "b2": 0.5}


def test_look_ahead_modulates_the_weights() -> None:
    """Round 0: a's one-step greedy successor scores 0.1, b's 0.9; the modulated scores are 0.5 and
    0.75 (odds 1 and 3), so b, not a, carries 3/4 of the weight (without the look-ahead a has
    9/10). No annealing at threshold 0."""
    gen, scorer = Counting(LA_TABLE), ScriptedStepScorer(LA_SCORES)
    result = EntropicParticleFiltering(step_scorer=scorer, n=2, params=P, entropy_threshold=0.0, lookahead=1).run(
        "Q", gen, ledger=Ledger())
    nodes = by_text(tree_of(result))
    a, b = nodes["a"], nodes["b"]
    assert a["lookahead"] == "a1\n\n" and b["lookahead"] == "b1\n\n"
    assert (a["lookahead_score"], b["lookahead_score"]) == (0.1, 0.9)
    assert a["modulated_score"] == pytest.approx(0.5, abs=1e-6) and b["modulated_score"] == pytest.approx(0.75, abs=1e-6)
    assert (a["weight"], b["weight"]) == pytest.approx((0.25, 0.75), abs=1e-6)
    assert (a["score"], b["score"]) == (0.9, 0.5)  # the nodes keep their own scores
    # without the look-ahead, the same steps weigh 0.9 : 0.1
    off = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(LA_SCORES), n=2, params=P, entropy_threshold=0.0,
                                    lookahead=0).run("Q", Counting(LA_TABLE), ledger=Ledger())
    assert by_text(tree_of(off))["a"]["weight"] == pytest.approx(0.9, abs=1e-6)
    assert "lookahead" not in by_text(tree_of(off))["a"]


def test_the_look_ahead_is_charged_and_scored_in_the_rounds_call() -> None:
    """Each round: one generator call for the particles' steps, one per look-ahead step for the
    rollouts, and one step-scorer call for both; the ledger's output tokens are the tree's
    tokens plus the rollouts'."""
    gen, scorer = Counting(LA_TABLE), ScriptedStepScorer(LA_SCORES)
    result = EntropicParticleFiltering(step_scorer=scorer, n=2, params=P, entropy_threshold=0.0, lookahead=1).run(
        "Q", gen, ledger=Ledger())
    tree = tree_of(result)
    rounds = len(tree["rounds"])
    assert rounds >= 2
    assert len(scorer.calls) == rounds == result.usage.scorer_calls
    # round 0: the two first steps (one request, n = 2), then both rollouts (two requests)
    assert gen.calls[:2] == [1, 2]
    assert [len(p) for p in scorer.calls[0]] == [1, 1, 2, 2]  # a, b, then a + a1, b + b1
    nodes = tree["nodes"]
    assert result.usage.output_tokens == (sum(n["tokens"] for n in nodes)
                                          + sum(n.get("lookahead_tokens", 0) for n in nodes))
    assert result.usage.output_tokens == sum(r["usage"]["output_tokens"] for r in tree["rounds"])
    assert result.usage.input_tokens == sum(r["usage"]["input_tokens"] for r in tree["rounds"])
    # a deeper look-ahead: two rollout calls in round 0
    deep = Counting(LA_TABLE)
    EntropicParticleFiltering(step_scorer=ScriptedStepScorer(LA_SCORES), n=2, params=P, lookahead=2).run(
        "Q", deep, ledger=Ledger())
    assert deep.calls[:3] == [1, 2, 2]


def test_a_budget_stop_ends_cleanly() -> None:
    # scorer calls: one allowed, round 0's; the stop comes at round 1's scoring
    result = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(LA_SCORES), n=2, params=P, lookahead=1).run(
        "Q", Counting(LA_TABLE), ledger=Ledger(budget=Budget(scorer_calls=1)))
    assert result.stopped_reason == "budget" and result.candidates and result.best is not None
    kinds = [e.kind for e in result.trace]
    assert kinds[-1] == "tree" and kinds.count("budget") == 1 and "entropy" in kinds
    assert tree_of(result)["stop"] == "budget"
    assert result.usage.scorer_calls == 2  # the call that ran over is charged, then refused
    # output tokens: the budget runs out inside the first round's rollouts
    cut = EntropicParticleFiltering(step_scorer=ScriptedStepScorer(LA_SCORES), n=2, params=P, lookahead=1).run(
        "Q", Counting(LA_TABLE), ledger=Ledger(budget=Budget(output_tokens=5)))
    assert cut.stopped_reason == "budget" and tree_of(cut)["stop"] == "budget"
    assert cut.usage.scorer_calls == 0 and [e.kind for e in cut.trace][-1] == "tree"


@pytest.mark.parametrize("field, value", [("entropy_threshold", 1.0), ("entropy_threshold", -0.1),
                                          ("entropy_threshold", "0.5"), ("entropy_threshold", True),
                                          ("lookahead", -1), ("lookahead", 1.5), ("lookahead", True),
                                          ("n", 0), ("temperature", 0.0), ("ess_threshold", 1.5)])
def test_bad_configuration_is_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidParameter, match=field):
        EntropicParticleFiltering(step_scorer=ScriptedStepScorer({}), **{field: value})


def test_registered_by_name() -> None:
    strategy = build_strategy("entropic_particle_filtering", {"step_scorer": "countdown", "n": "6",
                                                              "entropy_threshold": "0.8", "lookahead": "2"}, {})
    assert isinstance(strategy, EntropicParticleFiltering)
    assert (strategy.n, strategy.entropy_threshold, strategy.lookahead) == (6, 0.8, 2)
