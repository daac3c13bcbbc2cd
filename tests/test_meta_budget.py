"""Budgets stop strategies cleanly with what they have; scorer failures are typed and keep
the partial result; nested strategies charge child ledgers."""

import pytest

from metaloom.errors import ScorerFailed
from metaloom.ledger import Budget, Ledger, Usage
from metaloom.meta import MBR, AdaptiveVote, BestOfN, Chain, MajorityVote, PrunedBestOfN, Refine, WeightedVote
from metaloom.score.answers import LastNumber
from metaloom.score.feedback import FunctionFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.testing.scripted import FailingScorer, ScriptedGenerator, ScriptedScorer

TABLE = {"Q": ["4", "4", "5", "4"]}


def test_budget_stop_keeps_the_rounds_already_drawn():
    g = ScriptedGenerator(TABLE)
    ledger = Ledger(budget=Budget(output_tokens=5))
    r = AdaptiveVote(batch=2, max_samples=8, min_samples=8, extractor=LastNumber()).run("Q", g, ledger=ledger)
    assert r.stopped_reason == "budget"
    # the second round was cut mid-generation: its partial samples come back too, and the
    # vote over what was said before the stop picks the answer
    assert [c.finish_reason for c in r.candidates] == ["stop", "stop", "budget", "budget"]
    assert r.answer == "4" and r.best_index in (0, 1)
    assert r.trace[-1].kind == "budget" and r.trace[-1].data == {"field": "output_tokens", "limit": 5, "value": 6}
    assert r.usage == ledger.usage == Usage(input_tokens=2, output_tokens=6, forward_passes=3)


def test_budget_on_scorer_calls_stops_before_the_selection():
    g = ScriptedGenerator(TABLE)
    r = BestOfN(n=4, scorer=SequenceLogprob()).run("Q", g, ledger=Ledger(budget=Budget(scorer_calls=0)))
    assert r.stopped_reason == "budget" and len(r.candidates) == 4
    assert r.scores == () and r.best_index is None and r.best == ""


def test_budget_stop_during_the_first_generation_keeps_what_was_generated():
    g = ScriptedGenerator({"Q": ["a1 a2 a3 a4", "b1 b2 b3 b4"]})
    r = PrunedBestOfN(n=2, chunk_tokens=2, max_tokens=2).run("Q", g, ledger=Ledger(budget=Budget(forward_passes=1)))
    assert r.stopped_reason == "budget"
    assert [(c.text, c.finish_reason) for c in r.candidates] == [("a1", "budget"), ("b1", "budget")]
    assert (r.best, r.best_index) == ("", None)  # nothing was scored: no choice is made up
    assert r.usage == Usage(input_tokens=1, output_tokens=2, forward_passes=2)


def test_a_nested_strategy_on_our_budget_stops_us_too():
    think = "Q\nLet's think step by step."
    table = {think: [" a", " b"], think + "\na\nTherefore, the final answer is": [" 1"],
             think + "\nb\nTherefore, the final answer is": [" 2"]}
    g = ScriptedGenerator(table)
    ledger = Ledger(budget=Budget(forward_passes=3))
    r = MajorityVote(n=2, inner=Chain(max_tokens=(4, 2)), extractor=LastNumber()).run("Q", g, ledger=ledger)
    assert r.stopped_reason == "budget"
    nested = [e for e in r.trace if e.kind == "nested"]
    assert len(nested) == 1 and nested[0].data["stopped_reason"] == "budget"
    assert len(g.requests) == 2  # the first chain's two calls, nothing after


def test_child_ledgers_forward_to_the_parent():
    g = ScriptedGenerator(TABLE)
    parent = Ledger()
    first = MajorityVote(n=2, extractor=LastNumber()).run("Q", g, ledger=parent)
    second = MajorityVote(n=2, extractor=LastNumber()).run("Q", g, ledger=parent)
    assert first.usage + second.usage == parent.usage


@pytest.mark.parametrize("strategy", [
    BestOfN(n=4, scorer=FailingScorer("reward model out of memory")),
    WeightedVote(scorer=FailingScorer("reward model out of memory"), n=4, extractor=LastNumber()),
])
def test_scorer_failure_names_the_scorer_and_keeps_the_candidates(strategy):
    with pytest.raises(ScorerFailed, match="'failing' failed: RuntimeError: reward model out of memory") as info:
        strategy.run("Q", ScriptedGenerator(TABLE), ledger=Ledger())
    assert info.value.scorer == "failing" and isinstance(info.value.cause, RuntimeError)
    partial = info.value.partial
    assert partial.stopped_reason == "scorer_failed" and len(partial.candidates) == 4
    assert partial.trace[-1].kind == "scorer_failed" and partial.usage.scorer_calls == 1


def test_a_scorer_with_the_wrong_number_of_scores_fails_typed():
    bad = ScriptedScorer(fn=len)
    object.__setattr__(bad, "score", lambda prompt, cands, *, ledger: [1.0])
    with pytest.raises(ScorerFailed, match="returned 1 scores for 4 candidates"):
        BestOfN(n=4, scorer=bad).run("Q", ScriptedGenerator(TABLE), ledger=Ledger())


def test_failing_utility_and_feedback_are_named_too():
    class Broken:
        name = "broken_utility"

        def __call__(self, hyps, refs):
            raise ValueError("no metric")

    with pytest.raises(ScorerFailed, match="broken_utility") as info:
        MBR(n=4, utility=Broken()).run("Q", ScriptedGenerator(TABLE), ledger=Ledger())
    assert len(info.value.partial.candidates) == 4

    def crash(q, text):
        raise OSError("sandbox gone")

    with pytest.raises(ScorerFailed, match="'function' failed: OSError") as info:
        Refine(feedback=FunctionFeedback(crash)).run("Q", ScriptedGenerator(TABLE), ledger=Ledger())
    assert [c.text for c in info.value.partial.candidates] == ["4"]
