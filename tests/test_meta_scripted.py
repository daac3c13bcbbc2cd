"""The scripted generator charges like the local engine and plays its table faithfully."""

import pytest

from metaloom.errors import BudgetExceeded
from metaloom.generator.types import Generator, Request
from metaloom.ledger import Budget, Ledger, Usage
from metaloom.sampling.params import SamplingParams
from metaloom.testing.scripted import EOS_ID, FailingScorer, Say, ScriptedGenerator, ScriptedScorer, count_tokens, tokens


def test_tokens_round_trip():
    assert tokens(" so it is 4") == [" so", " it", " is", " 4"]
    assert "".join(tokens("a  b\nc ")) == "a  b\nc "
    assert count_tokens("one two three") == 3


def test_n_samples_charge_the_prompt_once_and_the_longest_row_in_forwards():
    g = ScriptedGenerator({"what is 2 + 2": [Say("it is 4", -0.5), "4", "maybe five or 4"]})
    assert isinstance(g, Generator)
    ledger = Ledger()
    out = g.generate([Request("what is 2 + 2", SamplingParams(n=4))], ledger=ledger)[0]
    assert [c.text for c in out] == ["it is 4", "4", "maybe five or 4", "it is 4"]  # cycles through the script
    assert [len(c.token_ids) for c in out] == [4, 2, 5, 4]  # words + end-of-sequence
    assert out[0].token_ids[-1] == EOS_ID and out[0].finish_reason == "stop"
    assert out[0].logprobs == (-0.5,) * 4 and out[1].logprobs == (-1.0,) * 2
    # prompt 5 tokens once; 1 prefill forward + 4 decode forwards (longest row: 5 tokens)
    assert ledger.usage == Usage(input_tokens=5, output_tokens=15, forward_passes=5)


def test_max_tokens_and_stop_strings():
    g = ScriptedGenerator({"q": ["a b c d e"]})
    ledger = Ledger()
    c = g.generate([Request("q", SamplingParams(max_tokens=3))], ledger=ledger)[0][0]
    assert (c.text, c.finish_reason, len(c.token_ids)) == ("a b c", "length", 3)
    c = g.generate([Request("q", SamplingParams(stop=(" c",)))], ledger=ledger)[0][0]
    assert (c.text, c.finish_reason, len(c.token_ids)) == ("a b", "stop", 3)  # the stop token is generated, its text cut


def test_batched_requests_share_one_prefill():
    g = ScriptedGenerator({"x": ["1 2 3"], "y y": ["1"]})
    ledger = Ledger()
    g.generate([Request("x"), Request("y y")], ledger=ledger)
    assert ledger.usage == Usage(input_tokens=3, output_tokens=6, forward_passes=4)


def test_continuation_resumes_the_response_that_produced_the_text():
    g = ScriptedGenerator({"Q:": [" the answer is 4", " the answer is 5"]})
    ledger = Ledger()
    first = g.generate([Request("Q:", SamplingParams(n=2, max_tokens=2))], ledger=ledger)[0]
    assert [c.text for c in first] == [" the answer", " the answer"]
    more = g.generate([Request("Q:" + c.text, SamplingParams(max_tokens=9)) for c in first], ledger=ledger)
    # both partials are the same text, so the script cannot tell them apart: it resumes the
    # response that produced that text last; distinct texts resume exactly
    assert [m[0].text for m in more] == [" is 5", " is 5"]
    g2 = ScriptedGenerator({"Q:": [" so 4", " thus 5"]})
    parts = g2.generate([Request("Q:", SamplingParams(n=2, max_tokens=1))], ledger=ledger)[0]
    more = g2.generate([Request("Q:" + c.text) for c in parts], ledger=ledger)
    assert [m[0].text for m in more] == [" 4", " 5"]


def test_longest_key_wins_and_unknown_prompts_raise():
    g = ScriptedGenerator({"Q": ["a"], "Q and more": ["b"]})
    assert g.generate([Request("Q and more")], ledger=Ledger())[0][0].text == "b"
    with pytest.raises(LookupError):
        g.generate([Request("nothing")], ledger=Ledger())


def test_chat_prompts_are_their_last_user_message():
    g = ScriptedGenerator({"hi": ["hello"]})
    c = g.generate([Request.chat("hi", system="be nice")], ledger=Ledger())[0][0]
    assert c.text == "hello"
    assert g.render(({"role": "user", "content": "hi"},)) == "hi"


def test_stream_charges_step_by_step_and_stops_when_closed():
    g = ScriptedGenerator({"q": ["a b c d"]})
    ledger = Ledger()
    chunks = list(g.stream(Request("q"), ledger=ledger))
    assert "".join(c.text for c in chunks) == "a b c d" and chunks[-1].finish_reason == "stop"
    assert ledger.usage == Usage(input_tokens=1, output_tokens=5, forward_passes=5)
    ledger = Ledger()
    s = g.stream(Request("q"), ledger=ledger)
    next(s), next(s)
    s.close()
    assert ledger.usage == Usage(input_tokens=1, output_tokens=2, forward_passes=2)
    g = ScriptedGenerator({"q": ["a b", "c d e"]})
    chunks = list(g.stream(Request("q", SamplingParams(n=2)), ledger=Ledger()))  # any n: chunks say whose
    assert ["".join(c.text for c in chunks if c.index == i) for i in (0, 1)] == ["a b", "c d e"]
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop", "stop"]


def test_a_budget_mid_generation_ends_the_rows_with_what_they_have():
    g = ScriptedGenerator({"q": ["a b c d"]})
    ledger = Ledger(budget=Budget(output_tokens=2))
    (c,) = g.generate([Request("q")], ledger=ledger)[0]
    assert (c.text, c.finish_reason) == ("a b c", "budget")  # the third token passed the limit; it is kept
    assert ledger.usage.output_tokens == 3
    with pytest.raises(BudgetExceeded):
        ledger.check()


def test_scripted_scorers():
    from metaloom.generator.types import Completion

    cands = [Completion(" a ", (1,), (0.0,), "stop"), Completion("b", (1,), (0.0,), "stop")]
    ledger = Ledger()
    assert ScriptedScorer({"a": 1.0, "b": 2.0}).score("q", cands, ledger=ledger) == [1.0, 2.0]
    assert ScriptedScorer(fn=len).score("q", cands, ledger=ledger) == [3.0, 1.0]
    with pytest.raises(RuntimeError):
        FailingScorer().score("q", cands, ledger=ledger)
    assert ledger.usage.scorer_calls == 3
