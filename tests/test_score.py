"""Scoring continuations: equal to token-by-token decoding, independent of batching, charged
per batch, on toy tables and the default model, through the function and the CLI."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from metaloom.decode.score import score_continuations, score_texts, split_continuation
from metaloom.errors import ContextWindowExceeded, InvalidParameter
from metaloom.generator import Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.testing.table_models import i_have_a_an
from metaloom.testing.toy_models import MarkovModel


def _step_by_step(model, prompt, continuation):
    """Log-probabilities of the continuation, one token per forward."""
    cache = model.new_cache(1, len(prompt) + len(continuation))
    logits = model.forward(torch.tensor([prompt]), cache, last_only=True)[0, -1]
    out = []
    for token in continuation:
        out.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
        logits = model.forward(torch.tensor([[token]]), cache)[0, -1]
    return out


def test_table_model_scores_are_exact():
    model = i_have_a_an()
    tok = model.tokenizer
    scores = score_texts(model, tok, "I have", [" an apple <eos>", " a pear", " an pear"], Ledger())
    assert scores[0].logprobs == pytest.approx((math.log(0.3), 0.0, 0.0))
    assert scores[1].logprob == pytest.approx(math.log(0.7 / 3))
    assert scores[2].logprobs[1] == float("-inf")  # impossible after "an"
    assert scores[0].text == " an apple <eos>" and scores[0].mean_logprob == pytest.approx(math.log(0.3) / 3)


def test_toy_scores_equal_token_by_token_and_batching_does_not_change_them():
    model = MarkovModel.random(9, seed=2)
    prompt = [1, 4, 2]
    continuations = [[3], [0, 5, 5, 1], [8, 7], [2, 2, 2, 2, 2, 6], [4]]
    ledger = Ledger()
    batched = score_continuations(model, prompt, continuations, ledger, batch_size=2)
    single = score_continuations(model, prompt, continuations, Ledger(), batch_size=1)
    for cont, a, b in zip(continuations, batched, single, strict=True):
        assert a.tokens == tuple(cont)
        assert a.logprobs == pytest.approx(_step_by_step(model, prompt, cont), abs=1e-6)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert a.logprob == pytest.approx(sum(a.logprobs))
    u = ledger.usage
    assert u.forward_passes == 1 + 3  # the prompt once, then one forward per batch of two
    assert (u.input_tokens, u.output_tokens) == (3 + sum(map(len, continuations)), 0)


def test_real_model_scores_equal_the_greedy_decoding_logprobs(smollm, smollm_generator):
    tok = smollm.tokenizer
    request = Request.chat("Name three colours.", SamplingParams(temperature=0, max_tokens=8))
    done = smollm_generator.generate([request], ledger=Ledger())[0][0]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours."}]),
                        add_special_tokens=False)
    other = tok.encode(" Blue, green", add_special_tokens=False)
    ledger = Ledger()
    together = score_continuations(smollm.model, prompt, [list(done.token_ids), other, done.token_ids[:3]], ledger)
    assert together[0].logprobs == pytest.approx(done.logprobs, abs=1e-4)
    assert together[2].logprobs == pytest.approx(done.logprobs[:3], abs=1e-4)
    alone = score_continuations(smollm.model, prompt, [other], Ledger())[0]
    assert alone.logprobs == pytest.approx(together[1].logprobs, abs=1e-4)
    assert alone.logprobs == pytest.approx(_step_by_step(smollm.model, prompt, other), abs=1e-4)
    assert ledger.usage.forward_passes == 2


def test_scoring_reuses_the_prefix_cache_and_gives_the_same_logprobs(smollm, smollm_generator):
    """An LLM judge asks one question per path; the questions share the problem. With a prefix
    cache the second question computes only what is new, and scores the same."""
    from metaloom.generator import LocalGenerator
    from metaloom.prefix.pool import PrefixCache

    cached = LocalGenerator(smollm, prefix_cache=PrefixCache(64 << 20))
    problem = "A farmer has 17 sheep and buys 5 more, then sells 8 of them at the market on Sunday. "
    questions = [problem + f"Step: 17 + 5 = {v}. Is this step correct? Answer Yes or No." for v in (22, 23)]
    first, second, plain = Ledger(), Ledger(), Ledger()
    cached.score(questions[0], [" Yes", " No"], ledger=first)
    got = cached.score(questions[1], [" Yes", " No"], ledger=second)
    want = smollm_generator.score(questions[1], [" Yes", " No"], ledger=plain)
    for a, b in zip(got, want, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    shared = len(smollm.tokenizer.encode(problem)) - 2  # the question's common tokens, give or take a merge
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens >= shared
    assert second.usage.input_tokens == plain.usage.input_tokens
    assert second.usage.flops < plain.usage.flops


def test_split_continuation_follows_the_joint_tokenisation(smollm):
    tok = smollm.tokenizer
    context, cont = split_continuation(tok, "The capital of France is", " Paris")
    assert context == tok.encode("The capital of France is")
    assert context + cont == tok.encode("The capital of France is Paris")


@pytest.mark.parametrize(("prompt", "continuations", "kwargs", "error"), [
    ([1], [[]], {}, InvalidParameter),
    ([], [[1]], {}, InvalidParameter),
    ([1], [[1]], {"batch_size": 0}, InvalidParameter),
    ([1] * 10, [[1] * 10], {}, ContextWindowExceeded),
])
def test_bad_input_is_a_typed_error(prompt, continuations, kwargs, error):
    model = MarkovModel(torch.zeros(3, 3), max_context=16)
    ledger = Ledger()
    with pytest.raises(error):
        score_continuations(model, prompt, continuations, ledger, **kwargs)
    assert ledger.usage.forward_passes == 0


def test_empty_continuation_text_is_a_typed_error():
    model = i_have_a_an()
    with pytest.raises(InvalidParameter):
        score_texts(model, model.tokenizer, "I have", [" an apple", ""], Ledger())


METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


def test_cli_score_json():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([METALOOM, "score", "The capital of France is", "--raw", "--continuation", " Paris.",
                          "--continuation", " a large banana", "--json"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    paris, banana = data["continuations"]
    assert paris["text"] == " Paris." and banana["text"] == " a large banana"
    for c in (paris, banana):
        assert len(c["tokens"]) == len(c["logprobs"]) >= 1
        assert c["logprob"] == pytest.approx(sum(c["logprobs"])) and c["logprob"] < 0
    assert paris["logprob"] > banana["logprob"]
    assert data["usage"]["forward_passes"] == 2 and data["usage"]["output_tokens"] == 0
    bad = subprocess.run([METALOOM, "score", "hi", "--continuation", ""], capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "continuation" in bad.stderr
