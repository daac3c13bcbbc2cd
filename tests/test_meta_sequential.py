"""Golden tables for refinement, budget forcing and the adaptive strategies."""


import pytest

from metaloom.errors import InvalidParameter
from metaloom.ledger import Ledger, Usage
from metaloom.meta import AdaptiveVote, BudgetForcing, FirstFinish, PrunedBestOfN, Refine
from metaloom.meta.adaptive_vote import beta_above_half, confidence
from metaloom.meta.refine import REVISE
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.feedback import CRITIQUE_TEMPLATE, CritiqueFeedback, FunctionFeedback, ScorerFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.protocols import Raw
from metaloom.testing.scripted import Say, ScriptedGenerator, ScriptedScorer, count_tokens, word_id


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
    r, g = run(Refine(feedback=ScorerFeedback(scorer), rounds=1), {"Q": ["5"], ask: ["6"]}, prompt=CHAT)
    assert [c.text for c in r.candidates] == ["5", "6"] and r.best_index == 0 and r.scores == (0.3, 0.1)
    assert (r.best, r.stopped_reason) == ("5", None)  # no answer passed: the best-scored, not the last
    assert [(e.kind, e.data["round"]) for e in r.trace] == [("generate", 0), ("feedback", 0), ("revise", 1), ("feedback", 1)]
    assert [e.data["passed"] for e in r.trace if e.kind == "feedback"] == [False, False]
    assert len(g.requests) == 2  # rounds=1: one revision, then it stops
    # a scorer verdict charges a scorer call and no tokens; the revision re-sends the grown chat
    assert r.usage == Usage(input_tokens=1 + count_tokens(ask), output_tokens=2 + 2, forward_passes=2 + 2, scorer_calls=2)


def test_refine_with_prompted_critique_on_raw_prompts():
    critique = CRITIQUE_TEMPLATE.format(prompt="Q:", candidate=" 4")
    table = {"Q:": [" 4"], critique: ["CORRECT"]}
    r, g = run(Refine(), table, prompt=Raw("Q:"))  # feedback=None: the generator critiques itself
    assert (r.best, r.best_index, r.scores, r.stopped_reason) == (" 4", 0, (1.0,), None)
    assert [c.text for c in r.candidates] == [" 4"]
    assert [e.to_dict() for e in r.trace] == [
        {"kind": "generate", "round": 0, "tokens": 2, "finish_reason": "stop",
         "usage": {"input_tokens": 1, "output_tokens": 2, "forward_passes": 2}},
        {"kind": "feedback", "round": 0, "passed": True, "message": "CORRECT", "score": None,
         "usage": {"input_tokens": count_tokens(critique), "output_tokens": 2, "forward_passes": 2, "scorer_calls": 1}},
    ]
    # the answer is sampled on the raw prompt; the critique is a greedy chat request of its own
    assert g.requests[0].prompt == "Q:" and g.requests[0].params.temperature == 0.7
    assert g.requests[1].prompt == ({"role": "user", "content": critique},)
    assert g.requests[1].params.greedy and g.requests[1].params.max_tokens == CritiqueFeedback(g).max_tokens
    assert r.usage == Usage(input_tokens=1 + 24, output_tokens=2 + 2, forward_passes=2 + 2, scorer_calls=1)


def test_refine_revises_a_raw_prompt_after_a_failed_critique():
    critique = [CRITIQUE_TEMPLATE.format(prompt="Q:", candidate=c) for c in (" 5", " 4")]
    revision = "Q: 5\n\n" + REVISE.format(feedback="5 is wrong: 2 + 2 = 4.") + "\n\n"  # answer and feedback appended
    table = {"Q:": [" 5"], critique[0]: ["5 is wrong: 2 + 2 = 4."], revision: [" 4"], critique[1]: ["CORRECT"]}
    r, g = run(Refine(rounds=1, params=SamplingParams(temperature=0.7, seed=7)), table, prompt=Raw("Q:"))
    assert [c.text for c in r.candidates] == [" 5", " 4"] and (r.best, r.best_index, r.scores) == (" 4", 1, (0.0, 1.0))
    feedback = [e.data for e in r.trace if e.kind == "feedback"]
    assert [(f["passed"], f["message"]) for f in feedback] == [(False, "5 is wrong: 2 + 2 = 4."), (True, "CORRECT")]
    assert [q.prompt for q in g.requests[::2]] == ["Q:", revision]
    assert [q.params.seed for q in g.requests] == [7, None, 8, None]  # each round reseeded; critiques greedy
    # both critiques quote the original question (24 tokens each), not the grown revision prompt
    assert r.usage == Usage(input_tokens=1 + 24 + count_tokens(revision) + 24, output_tokens=2 + 9 + 2 + 2,
                            forward_passes=2 + 9 + 2 + 2, scorer_calls=2)


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
    r, g = run(BudgetForcing(max_thinking_tokens=3), table)
    assert (r.best, r.best_index) == ("7", 0)
    assert r.candidates[0].text == "a b c</think>\nFinal answer: 7"
    assert [e.kind for e in r.trace] == ["think", "thinking", "answer"]
    assert next(e for e in r.trace if e.kind == "thinking").data == {"tokens": 3, "waits": 0, "forced_answer": True}
    assert [q.params.max_tokens for q in g.requests] == [3, 64]
    # "Q<think>\n" is 2 tokens; the forced answer's prompt "Q<think>\na b c</think>\nFinal answer:" is 6
    assert r.usage == Usage(input_tokens=2 + 6, output_tokens=3 + 2, forward_passes=3 + 2)
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
    r, g = run(AdaptiveVote(batch=3, max_samples=7, extractor=LastNumber()), {"Q": ["4", "5"]})
    assert len(r.candidates) == 7 and r.answer == "4"  # rounds of 3, 3, then the 1 left
    assert [q.params.n for q in g.requests] == [3, 3, 1]
    assert [e.data["tally"] for e in r.trace if e.kind == "vote"] == [{"4": 2, "5": 1}, {"4": 3, "5": 3}, {"4": 4, "5": 3}]
    # P(Beta(1 + lead, 1 + second) > 1/2): 11/16, 1/2 (a tie), 163/256 — never the 0.95 asked for
    assert [e.data["confidence"] for e in r.trace if e.kind == "round"] == [11 / 16, 0.5, 163 / 256]
    assert next(e for e in r.trace if e.kind == "adaptive").data == {"samples": 7, "saved": 0, "confidence": 163 / 256,
                                                                    "rule": "dirichlet"}
    assert r.usage == Usage(input_tokens=3, output_tokens=2 * 7, forward_passes=2 * 3)


FINISH = {"Q": ["a b c d e f g h", "p q r", "x y z w v u t s r q"]}


def test_first_finish_in_rounds_stops_the_rest():
    r, g = run(FirstFinish(n=3, chunk_tokens=2, growth=2.0, max_tokens=20), FINISH)
    assert r.best == "p q r" and r.best_index == 1
    assert [c.text for c in r.candidates] == ["a b c d e f", "p q r", "x y z w v u"]
    assert [q.params.max_tokens for q in g.requests] == [2, 4, 4, 4]
    # round 1 continues each sample exactly from its own tokens: the prompt, then its 2 tokens
    first = [tuple(word_id(w) for w in words) for words in (("a", " b"), ("p", " q"), ("x", " y"))]
    assert [q.prefix for q in g.requests] == [(), *first] and all(q.prompt == CHAT for q in g.requests)
    # round 0: one request, n=3; round 1: three requests of 1 + 2 input tokens
    assert r.usage == Usage(input_tokens=1 + 3 * 3, output_tokens=6 + 10, forward_passes=2 + 4)
    event = next(e for e in r.trace if e.kind == "first_finish").data
    assert event["winner"] == 1 and event["rounds"] == 2


def test_first_finish_streaming_closes_the_losers():
    r, g = run(FirstFinish(n=3, max_tokens=20, mode="stream"), FINISH)
    assert r.best == "p q r"
    # one request with three samples, streamed step by step; the winner's end closed the
    # stream before the third sample's fourth chunk was read
    assert len(g.requests) == 1 and g.requests[0].params.n == 3
    assert [len(c.token_ids) for c in r.candidates] == [4, 4, 3]
    assert [c.finish_reason for c in r.candidates] == ["cancelled", "stop", "cancelled"]
    assert all(lp == -1.0 for c in r.candidates for lp in c.logprobs)  # chunks carry log-probabilities
    # the prompt once; the fourth step ran for all three samples before the stream was closed
    assert r.usage == Usage(input_tokens=1, output_tokens=12, forward_passes=4)


def test_first_finish_without_a_finisher_keeps_the_first():
    r, g = run(FirstFinish(n=2, chunk_tokens=2, max_tokens=3), {"Q": ["a b c d e", "x y z w v"]})
    assert r.best == "a b c" and r.best_index == 0
    assert next(e for e in r.trace if e.kind == "first_finish").data == {
        "mode": "rounds", "winner": None, "finished": 0, "tokens": [3, 3], "rounds": 2}
    # round 1 asks for what is left of max_tokens (1), not the grown chunk (4)
    assert [(q.params.n, q.params.max_tokens) for q in g.requests] == [(2, 2), (1, 1), (1, 1)]
    # (input tokens depend on how a sample is continued, checked in test_first_finish_in_rounds_stops_the_rest)
    assert (r.usage.output_tokens, r.usage.forward_passes) == (4 + 2, 2 + 1)
    assert next(e for e in r.trace if e.kind == "sample").data["usage"] == {"input_tokens": 1, "output_tokens": 4,
                                                                           "forward_passes": 2}


def test_pruned_best_of_n_follows_only_the_strong():
    table = {"Q": [Say("a1 a2 a3 a4 a5 a6", -0.1), Say("b1 b2 b3", -0.5), Say("c1 c2 c3 c4 c5 c6", -0.3),
                   Say("d1 d2 d3 d4 d5 d6", -0.2)]}
    r, _g = run(PrunedBestOfN(n=4, scorer=SequenceLogprob(normalize=True), chunk_tokens=2, keep_fraction=0.5,
                             max_tokens=8), table)
    prunes = [e.data for e in r.trace if e.kind == "prune"]
    assert [p["pruned"] for p in prunes] == [[1, 2], [3]]
    assert [c.text for c in r.candidates] == ["a1 a2 a3 a4 a5 a6"] and r.best_index == 0
    assert len(r.candidates[0].token_ids) == 7
    # each round continues the survivors from their tokens: the prompt plus 2, 4, 6 tokens
    assert r.usage == Usage(input_tokens=1 + 2 * (1 + 2) + (1 + 4) + (1 + 6), output_tokens=8 + 4 + 2 + 1,
                            forward_passes=2 + 2 + 2 + 1, scorer_calls=3)


def test_pruned_keeps_finished_samples_for_the_final_comparison():
    table = {"Q": [Say("a1 a2 a3 a4", -0.1), Say("b", -0.9), Say("c1 c2 c3 c4", -0.3)]}
    r, g = run(PrunedBestOfN(n=3, chunk_tokens=2, keep_fraction=0.5, max_tokens=6), table)
    assert [c.text for c in r.candidates] == ["a1 a2 a3 a4", "b"]  # "b" finished in the first chunk
    assert r.best == "a1 a2 a3 a4" and r.scores == pytest.approx((-0.1, -0.9))
    # only the unfinished samples are scored and pruned at the checkpoint: keep 1 of those 2
    prune = next(e for e in r.trace if e.kind == "prune").data
    assert prune == {"checkpoint": 2, "pruned": [2], "scores": {0: -0.1, 2: -0.3}}
    assert next(e for e in r.trace if e.kind == "select").data == {"sample": 0, "survivors": [0, 1], "score": -0.1}
    assert [(q.params.n, q.params.max_tokens) for q in g.requests] == [(3, 2), (1, 2), (1, 2)]
    # (input tokens depend on how a sample is continued, checked in test_pruned_best_of_n_follows_only_the_strong)
    assert (r.usage.output_tokens, r.usage.forward_passes, r.usage.scorer_calls) == (6 + 2 + 1, 2 + 2 + 1, 2)


def test_first_finish_continues_by_text_where_the_generator_takes_no_token_prefix():
    from metaloom.generator.capabilities import Capabilities

    class TextOnly(ScriptedGenerator):
        capabilities = Capabilities(decoders=frozenset(), constraints=frozenset(),
                                    features=frozenset({"render", "stream", "score"}))

    g = TextOnly(FINISH)
    r = FirstFinish(n=3, chunk_tokens=2, growth=2.0, max_tokens=20).run("Q", g, ledger=Ledger())
    assert r.best == "p q r" and [c.text for c in r.candidates] == ["a b c d e f", "p q r", "x y z w v u"]
    # round 1 re-sends the prompt with each sample's text so far ("Qa b" is 2 tokens here)
    assert [(q.prompt, q.prefix) for q in g.requests[1:]] == [("Qa b", ()), ("Qp q", ()), ("Qx y", ())]
    assert r.usage.input_tokens == 1 + 3 * 2
    assert next(e for e in r.trace if e.kind == "continue").data["exact"] is False
