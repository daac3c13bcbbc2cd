"""Golden tables for refinement, budget forcing and the adaptive strategies."""

import math

import pytest

from metaloom.errors import InvalidParameter
from metaloom.ledger import Ledger, Usage
from metaloom.meta import AdaptiveVote, BudgetForcing, FirstFinish, PrunedBestOfN, Refine
from metaloom.meta.adaptive_vote import beta_above_half, confidence
from metaloom.meta.refine import REVISE
from metaloom.score.answers import LastNumber
from metaloom.score.feedback import CritiqueFeedback, FunctionFeedback, ScorerFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.testing.scripted import Say, ScriptedGenerator, ScriptedScorer


def run(strategy, table, prompt="Q"):
    g = ScriptedGenerator(table)
    ledger = Ledger()
    r = strategy.run(prompt, g, ledger=ledger)
    assert r.usage == ledger.usage
    return r, g


CHAT = ({"role": "user", "content": "Q"},)


def _checker(q, text):
    return ("4" in text, "" if "4" in text else f"{text.strip()} is wrong: 2 + 2 is not {text.strip()}")


def test_refine_revises_until_the_verifier_passes():
    ask = [REVISE.format(feedback=f"{x} is wrong: 2 + 2 is not {x}") for x in ("5", "3")]
    table = {"Q": ["5"], ask[0]: ["3"], ask[1]: ["4"]}
    r, g = run(Refine(feedback=FunctionFeedback(_checker), rounds=3), table, prompt=CHAT)
    assert [c.text for c in r.candidates] == ["5", "3", "4"] and r.best == "4" and r.scores == (0.0, 0.0, 1.0)
    assert [e.data["passed"] for e in r.trace if e.kind == "feedback"] == [False, False, True]
    # the conversation grows: question, answer, feedback, answer, feedback
    assert [m["role"] for m in g.requests[2].prompt] == ["user", "assistant", "user", "assistant", "user"]
    assert r.usage.scorer_calls == 3 and r.usage.output_tokens == 6


def test_refine_stops_after_its_rounds_and_keeps_the_best_scored():
    ask = REVISE.format(feedback="A verifier rejected this answer (score 0.300 < 0.5). Find and fix the mistake.")
    scorer = ScriptedScorer({"5": 0.3, "6": 0.1})
    r, _ = run(Refine(feedback=ScorerFeedback(scorer), rounds=1), {"Q": ["5"], ask: ["6"]}, prompt=CHAT)
    assert [c.text for c in r.candidates] == ["5", "6"] and r.best_index == 0 and r.scores == (0.3, 0.1)


def test_refine_with_prompted_critique_on_raw_prompts():
    from metaloom.score.feedback import CRITIQUE_TEMPLATE

    critique = CRITIQUE_TEMPLATE.format(prompt="Q:", candidate=" 4")
    table = {"Q:": [" 4"], critique: ["CORRECT"]}
    r, g = run(Refine(), table, prompt="Q:")
    assert r.best == " 4" and len(r.candidates) == 1
    assert isinstance(CritiqueFeedback(g), CritiqueFeedback)


def test_budget_forcing_appends_wait_until_the_minimum():
    base = "Q<think>\n"
    table = {base: ["a b</think> c"], base + "a b\nWait": [" c d e f</think>"],
             base + "a b\nWait c d e f</think>\nFinal answer:": [" 42"]}
    r, g = run(BudgetForcing(min_thinking_tokens=5, max_thinking_tokens=20, extractor=LastNumber()), table)
    assert (r.best, r.answer) == ("42", "42")
    assert r.candidates[0].text == "a b\nWait c d e f</think>\nFinal answer: 42"
    thinking = next(e for e in r.trace if e.kind == "thinking").data
    assert thinking == {"tokens": 6, "waits": 1, "forced_answer": False}
    assert [q.params.max_tokens for q in g.requests] == [20, 18, 64]
    assert all(q.params.stop == ("</think>",) for q in g.requests[:2])
    assert r.usage == Usage(input_tokens=2 + 4 + 10, output_tokens=2 + 4 + 2, forward_passes=2 + 4 + 2)


def test_budget_forcing_cuts_at_the_maximum():
    base = "Q<think>\n"
    table = {base: ["a b c d e f"], base + "a b c</think>\nFinal answer:": [" 7"]}
    r, _ = run(BudgetForcing(max_thinking_tokens=3), table)
    assert r.best == "7"
    assert next(e for e in r.trace if e.kind == "thinking").data == {"tokens": 3, "waits": 0, "forced_answer": True}
    with pytest.raises(InvalidParameter, match="min_thinking_tokens"):
        BudgetForcing(min_thinking_tokens=10, max_thinking_tokens=5)


def test_beta_tail_is_exact():
    assert beta_above_half(1, 1) == 0.5
    assert beta_above_half(2, 1) == 0.75
    assert beta_above_half(5, 1) == 1 - 1 / 32
    assert confidence("share", [3, 1], 5) == 0.6
    assert confidence("dirichlet", [3, 1], 5) == beta_above_half(4, 2)
    assert confidence("beta", [3, 1], 5) == beta_above_half(4, 3)


@pytest.mark.parametrize(("rule", "threshold", "drawn"), [("share", 0.9, 2), ("dirichlet", 0.95, 4), ("beta", 0.99, 6)])
def test_adaptive_vote_stops_when_sure(rule, threshold, drawn):
    r, g = run(AdaptiveVote(batch=2, max_samples=8, min_samples=2, rule=rule, threshold=threshold,
                            extractor=LastNumber()), {"Q": ["4"]})
    assert len(r.candidates) == drawn and r.answer == "4"
    assert next(e for e in r.trace if e.kind == "adaptive").data["saved"] == 8 - drawn
    rounds = drawn // 2
    assert len(g.requests) == rounds
    assert r.usage == Usage(input_tokens=rounds, output_tokens=2 * drawn, forward_passes=2 * rounds)


def test_adaptive_vote_spends_everything_on_a_split_vote():
    r, _ = run(AdaptiveVote(batch=3, max_samples=7, extractor=LastNumber()), {"Q": ["4", "5"]})
    assert len(r.candidates) == 7 and r.answer == "4"  # rounds of 3, 3, then the 1 left
    assert next(e for e in r.trace if e.kind == "adaptive").data["saved"] == 0


FINISH = {"Q": ["a b c d e f g h", "p q r", "x y z w v u t s r q"]}


def test_first_finish_in_rounds_stops_the_rest():
    r, g = run(FirstFinish(n=3, chunk_tokens=2, growth=2.0, max_tokens=20), FINISH)
    assert r.best == "p q r" and r.best_index == 1
    assert [c.text for c in r.candidates] == ["a b c d e f", "p q r", "x y z w v u"]
    assert [q.params.max_tokens for q in g.requests] == [2, 4, 4, 4]
    # round 0: one request, n=3; round 1: each continued from its text ("Qa b" is 2 tokens)
    assert r.usage == Usage(input_tokens=1 + 6, output_tokens=6 + 10, forward_passes=2 + 4)
    event = next(e for e in r.trace if e.kind == "first_finish").data
    assert event["winner"] == 1 and event["rounds"] == 2


def test_first_finish_streaming_closes_the_losers():
    r, _ = run(FirstFinish(n=3, max_tokens=20, mode="stream"), FINISH)
    assert r.best == "p q r"
    assert [len(c.token_ids) for c in r.candidates] == [4, 4, 3]
    assert all(math.isnan(lp) for lp in r.candidates[0].logprobs)
    # each stream prefills its own prompt; the third was closed before its fourth token
    assert r.usage == Usage(input_tokens=3, output_tokens=11, forward_passes=4 + 4 + 3)


def test_first_finish_without_a_finisher_keeps_the_first():
    r, _ = run(FirstFinish(n=2, chunk_tokens=2, max_tokens=3), {"Q": ["a b c d e", "x y z w v"]})
    assert r.best == "a b c" and next(e for e in r.trace if e.kind == "first_finish").data["winner"] is None


def test_pruned_best_of_n_follows_only_the_strong():
    table = {"Q": [Say("a1 a2 a3 a4 a5 a6", -0.1), Say("b1 b2 b3", -0.5), Say("c1 c2 c3 c4 c5 c6", -0.3),
                   Say("d1 d2 d3 d4 d5 d6", -0.2)]}
    r, _g = run(PrunedBestOfN(n=4, scorer=SequenceLogprob(normalize=True), chunk_tokens=2, keep_fraction=0.5,
                             max_tokens=8), table)
    prunes = [e.data for e in r.trace if e.kind == "prune"]
    assert [p["pruned"] for p in prunes] == [[1, 2], [3]]
    assert [c.text for c in r.candidates] == ["a1 a2 a3 a4 a5 a6"] and r.best_index == 0
    assert len(r.candidates[0].token_ids) == 7
    assert r.usage == Usage(input_tokens=1 + 4 + 4 + 6, output_tokens=8 + 4 + 2 + 1, forward_passes=2 + 2 + 2 + 1,
                            scorer_calls=3)


def test_pruned_keeps_finished_samples_for_the_final_comparison():
    table = {"Q": [Say("a1 a2 a3 a4", -0.1), Say("b", -0.9), Say("c1 c2 c3 c4", -0.3)]}
    r, _ = run(PrunedBestOfN(n=3, chunk_tokens=2, keep_fraction=0.5, max_tokens=6), table)
    assert [c.text for c in r.candidates] == ["a1 a2 a3 a4", "b"]  # "b" finished in the first chunk
    assert r.best == "a1 a2 a3 a4"
