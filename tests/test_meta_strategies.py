"""Golden tables for the parallel strategies and chains: exact selections, exact ledgers."""

import math

import pytest

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Request
from metaloom.ledger import Ledger, Usage
from metaloom.meta import MBR, BestOfN, Chain, MajorityVote, Result, WeightedVote
from metaloom.score.answers import ChoiceLetter, CodeOutcomes, ExactString, LastNumber, MathAnswer
from metaloom.score.judge import JUDGE_TEMPLATE, PAIR_TEMPLATE, LLMJudge, PairwiseJudge
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.protocols import Raw
from metaloom.score.verifier import FunctionVerifier
from metaloom.testing.scripted import Say, ScriptedGenerator, ScriptedScorer, count_tokens

# four samples of one prompt; raw log-probability prefers B, per-token C, "contains 4" A
SAMPLES = [Say("x is 4", -0.1), Say("4", -0.15), Say("I think it is 5", -0.08), Say("so the answer is 4", -0.2)]
FOUR = Usage(input_tokens=1, output_tokens=4 + 2 + 6 + 6, forward_passes=6)


def run(strategy, table=None, prompt="Q", ledger=None):
    g = ScriptedGenerator(table or {"Q": SAMPLES})
    ledger = ledger or Ledger()
    result = strategy.run(prompt, g, ledger=ledger)
    assert isinstance(result, Result)
    assert result.usage == ledger.usage  # a fresh ledger: the result's usage is everything charged
    return result, g


def test_chain_thinks_then_answers():
    think = "Q?\nLet's think step by step."
    answer = think + "\n2 and 2 make 4.\nTherefore, the final answer is"
    table = {think: [" 2 and 2 make 4."], answer: [" 4."]}
    r, g = run(Chain(max_tokens=(16, 4), extractor=LastNumber()), table, prompt="Q?")
    assert (r.best, r.answer, r.best_index) == ("4.", "4", 1)
    assert [c.text for c in r.candidates] == [" 2 and 2 make 4.", " 4."]
    assert [req.params.max_tokens for req in g.requests] == [16, 4]
    assert r.usage == Usage(input_tokens=6 + 16, output_tokens=6 + 2, forward_passes=6 + 2)
    steps = [e for e in r.trace if e.kind == "step"]
    assert [e.data["usage"] for e in steps] == [{"input_tokens": 6, "output_tokens": 6, "forward_passes": 6},
                                                {"input_tokens": 16, "output_tokens": 2, "forward_passes": 2}]


def test_chain_keeps_chat_prompts_chat():
    r, g = run(Chain(steps=("Answer: {prompt}",), max_tokens=(4,)), {"Answer: hi": ["hello"]},
               prompt=({"role": "system", "content": "s"}, {"role": "user", "content": "hi"}))
    assert r.best == "hello"
    assert g.requests[0].prompt == ({"role": "system", "content": "s"}, {"role": "user", "content": "Answer: hi"})
    with pytest.raises(InvalidParameter, match="max_tokens"):
        Chain(steps=("a",), max_tokens=(1, 2))
    with pytest.raises(InvalidParameter, match="steps"):
        run(Chain(steps=("{nope}",), max_tokens=(1,)), {"x": ["y"]})


@pytest.mark.parametrize(("scorer", "best", "scores"), [
    (SequenceLogprob(), 1, [-0.4, -0.3, -0.48, -1.2]),
    (SequenceLogprob(normalize=True), 2, [-0.1, -0.15, -0.08, -0.2]),
    (FunctionVerifier(lambda q, text: "4" in text and q == "Q"), 0, [1.0, 1.0, 0.0, 1.0]),
    (ScriptedScorer({"x is 4": 0.1, "4": 0.2, "I think it is 5": 0.3, "so the answer is 4": 0.9}), 3, [0.1, 0.2, 0.3, 0.9]),
])
def test_best_of_n_charges_the_prompt_once(scorer, best, scores):
    r, g = run(BestOfN(n=4, scorer=scorer))
    assert len(g.requests) == 1 and g.requests[0].params.n == 4
    assert r.best_index == best and r.best == SAMPLES[best].text
    assert r.scores == pytest.approx(scores)
    assert r.usage == Usage(**{**FOUR.to_dict(), "scorer_calls": 1})
    assert r.stopped_reason is None


def test_best_of_n_with_a_judge_reads_p_yes():
    judge_table = {JUDGE_TEMPLATE.format(prompt="Q", candidate=s.text): [v] for s, v in zip(SAMPLES, [
        Say("Yes", -0.1), Say("No", -0.2), Say("Maybe", -0.1), Say("Yes.", -0.5)], strict=True)}
    g = ScriptedGenerator({"Q": SAMPLES, **judge_table})
    ledger = Ledger()
    r = BestOfN(n=4, scorer=LLMJudge(g, method="sample")).run("Q", g, ledger=ledger)
    assert r.scores == pytest.approx([math.exp(-0.1), 1 - math.exp(-0.2), 0.0, math.exp(-0.5)])
    assert r.best_index == 0
    judged = sum(count_tokens(k) for k in judge_table)
    # four one-token judge requests in one batched call: one prefill + no decode step
    assert r.usage == FOUR + Usage(input_tokens=judged, output_tokens=4, forward_passes=1, scorer_calls=1)
    assert all(req.params.max_tokens == 1 and req.params.greedy for req in g.requests[1:])


def test_majority_vote_marginalises_math_answers():
    table = {"Q": ["so x = 1/2", "x = 0.5", r"$\frac{1}{2}$", "x = 3", "no idea"]}
    r, _ = run(MajorityVote(n=5, extractor=MathAnswer()), table)
    assert r.answers[:4] == ("1/2", "0.5", "\\frac{1}{2}", "3") and r.answers[4] is None
    assert (r.best_index, r.answer) == (0, "1/2")
    vote = next(e for e in r.trace if e.kind == "vote")
    assert vote.data["tally"] == {"1/2": 3.0, "3": 1.0}
    assert r.usage == Usage(input_tokens=1, output_tokens=5 + 4 + 2 + 4 + 3, forward_passes=5)


@pytest.mark.parametrize(("extractor", "samples", "answer", "index"), [
    (LastNumber(), ["it is 1,000", "1000.0", "900", "maybe 900 or 1000"], "1000", 0),
    (ChoiceLetter(), ["The answer is (b)", "(C) is wrong, (B)", "C", "I pick A"], "B", 0),
    (ExactString(casefold=True), ["Paris", " paris ", "Lyon", "Lyon"], "paris", 0),
    (CodeOutcomes(lambda text: ["x" in text, "y" in text]), ["x", "xy", "yx", "q"], "PP", 1),
])
def test_majority_vote_extractors(extractor, samples, answer, index):
    r, _ = run(MajorityVote(n=4, extractor=extractor), {"Q": samples})
    assert (r.answer, r.best_index) == (answer, index)


def test_vote_ties_go_to_the_answer_seen_first_and_no_answer_keeps_the_first():
    r, _ = run(MajorityVote(n=4, extractor=LastNumber()), {"Q": ["5", "4", "4", "5"]})
    assert (r.answer, r.best_index) == ("5", 0)
    r, _ = run(MajorityVote(n=2, extractor=LastNumber()), {"Q": ["none", "nothing"]})
    assert (r.best_index, r.answer, r.best) == (0, None, "none")


def test_weighted_vote_can_overrule_the_majority():
    scorer = ScriptedScorer({"x is 4": 0.2, "4": 0.2, "I think it is 5": 0.9, "so the answer is 4": 0.3})
    r, _ = run(WeightedVote(scorer=scorer, n=4, extractor=LastNumber()))
    assert (r.answer, r.best_index) == ("5", 2)
    assert next(e for e in r.trace if e.kind == "vote").data["tally"] == pytest.approx({"4": 0.7, "5": 0.9})
    # log-probabilities as weights: exp turns them into the answers' total probability
    r, _ = run(WeightedVote(scorer=SequenceLogprob(), n=4, extractor=LastNumber(), transform="exp"))
    assert (r.answer, r.best_index) == ("4", 1)  # the best-scored sample of the winning answer
    with pytest.raises(InvalidParameter, match="exp"):
        run(WeightedVote(scorer=SequenceLogprob(), n=4, extractor=LastNumber()))


class Overlap:
    """Jaccard overlap of words: a utility with no model behind it."""

    name = "overlap"

    def __call__(self, hyps, refs):
        return [[len(set(h.split()) & set(r.split())) / len(set(h.split()) | set(r.split())) for r in refs] for h in hyps]


def test_mbr_picks_the_consensus_and_evaluates_distinct_texts_once():
    table = {"Q": ["the cat sat", "the cat sat", "a cat sat", "dogs run fast"]}
    r, _ = run(MBR(n=4, utility=Overlap()), table)
    # EU(the cat sat) = (1 + 1 + 0.5 + 0) / 4; EU(a cat sat) = (0.5 + 0.5 + 1 + 0) / 4; EU(dogs) = 1/4
    assert r.scores == pytest.approx([0.625, 0.625, 0.5, 0.25])
    assert r.best_index == 0
    event = next(e for e in r.trace if e.kind == "mbr")
    assert event.data["distinct"] == 3 and event.data["usage"] == {"scorer_calls": 1}


def test_mbr_with_a_pairwise_judge_charges_its_generations():
    answers = ["4", "four", "5"]
    verdicts = {("4", "four"): "Yes", ("four", "4"): "Yes", ("4", "5"): "No", ("5", "4"): "No",
                ("four", "5"): "No", ("5", "four"): "No"}
    judge_table = {PAIR_TEMPLATE.format(prompt="Q", a=a, b=b): [Say(v, math.log(0.8))] for (a, b), v in verdicts.items()}
    g = ScriptedGenerator({"Q": answers, **judge_table})
    ledger = Ledger()
    r = MBR(n=3, utility=PairwiseJudge(g, method="sample")).run("Q", g, ledger=ledger)
    u = next(e for e in r.trace if e.kind == "mbr").data["matrix"]
    assert [pytest.approx(row) for row in ([1, 0.8, 0.2], [0.8, 1, 0.2], [0.2, 0.2, 1])] == u
    assert r.best_index == 0 and r.scores == pytest.approx([2.0 / 3, 2.0 / 3, 1.4 / 3])
    asked = sum(count_tokens(k) for k in judge_table)
    assert r.usage == Usage(input_tokens=1 + asked, output_tokens=6 + 6, forward_passes=2 + 1, scorer_calls=1)


def test_best_of_n_over_an_inner_strategy_uses_child_ledgers():
    think = "Q\nLet's think step by step."
    table = {think: [" a", " b"], think + "\na\nTherefore, the final answer is": [" 1"],
             think + "\nb\nTherefore, the final answer is": [" 2"]}
    inner = Chain(max_tokens=(4, 2))
    r, g = run(BestOfN(n=2, inner=inner, scorer=ScriptedScorer({"1": 0.0, "2": 1.0})), table)
    assert [c.text for c in r.candidates] == ["1", "2"] and r.best == "2"
    nested = [e for e in r.trace if e.kind == "nested"]
    assert len(nested) == 2
    total = Usage()
    for e in nested:
        total = total + Usage(**e.data["usage"])
    assert r.usage == total + Usage(scorer_calls=1)
    assert len(g.requests) == 4  # two chains of two calls


def test_requests_are_what_the_strategy_claims():
    """A plain str is the user's message (the chat template applies, as `metaloom run` does);
    `Raw` text goes as it is."""
    _r, g = run(MajorityVote(n=3, extractor=LastNumber()))
    assert g.requests == [Request(({"role": "user", "content": "Q"},), g.requests[0].params)]
    _r, g = run(MajorityVote(n=3, extractor=LastNumber()), prompt=Raw("Q"))
    assert g.requests == [Request("Q", g.requests[0].params)] and type(g.requests[0].prompt) is Raw
    assert g.requests[0].params.n == 3 and g.requests[0].params.temperature == 0.7
