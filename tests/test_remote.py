"""`RemoteGenerator`: what detection finds (honoured, not merely accepted), how requests map to
OpenAI / vLLM bodies and answers back to completions, scoring and rendering through the server's
routes — on the fake OpenAI server — and, the point of it all, that strategies give the same
results through `RemoteGenerator` → `metaloom serve` as on the `LocalGenerator` directly."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

from metaloom.constrain.spec import ConstraintSpec
from metaloom.errors import Unsupported
from metaloom.generator import LocalGenerator
from metaloom.generator.capabilities import SAMPLING_FIELDS
from metaloom.generator.remote import RemoteGenerator, RetryPolicy
from metaloom.generator.remote.detect import VLLM_EXTRAS
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import Ledger, Usage
from metaloom.meta import (
    MBR,
    AdaptiveVote,
    BestOfN,
    BudgetForcing,
    Chain,
    FirstFinish,
    MajorityVote,
    PrunedBestOfN,
    Refine,
    WeightedVote,
)
from metaloom.sampling.params import SamplingParams
from metaloom.score.feedback import CritiqueFeedback
from metaloom.score.judge import LLMJudge
from metaloom.score.logprob import SequenceLogprob
from metaloom.server.app import create_app
from metaloom.testing.fake_openai import FakeFeatures, FakeOpenAI, chat_template, logprob
from metaloom.testing.served import serve_app
from metaloom.testing.tiny import tiny_llama

FAST = RetryPolicy(base_delay=0.01, max_delay=0.05)
REPLIES = {"hi": ["hello", "bye"], "<|user|>hi\n<|assistant|>": ["chat reply"]}


@pytest.fixture(scope="module")
def vllm():
    """A vLLM-shaped fake: lenient (unknown fields ignored), every vLLM feature on."""
    fake = FakeOpenAI(replies=REPLIES)
    with serve_app(fake.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        yield fake, g


def last(fake: FakeOpenAI, path: str = "/v1/completions") -> dict:
    return fake.bodies(path)[-1]


# --- detection ------------------------------------------------------------------------------------

def test_detection_on_a_vllm_like_server(vllm):
    _, g = vllm
    f = g.features
    assert (f.completions, f.chat, f.strict, f.n, f.logprobs, f.chat_logprobs, f.seed) == (True,) * 2 + (False,) + (True,) * 4
    assert (f.token_ids, f.prompt_logprobs, f.echo, f.token_prompts, f.guided, f.continuous_usage) == (True,) * 6
    assert (f.tokenize, f.tokenize_chat, f.detokenize, f.exact_usage, f.top_logprobs) == (True, True, True, False, False)
    assert f.extras == VLLM_EXTRAS  # a lenient server accepts anything: only vLLM's documented extras are trusted
    caps = g.capabilities
    assert {"top_k", "min_p", "repetition_penalty", "seed", "n"} <= caps.sampling
    assert "typical_p" not in caps.sampling and "top_logprobs" not in caps.sampling
    assert caps.constraints == {"json_schema", "regex", "lark", "choices"} and caps.decoders == frozenset()
    assert caps.features == {"token_ids", "logprobs", "score", "render", "stream", "token_prompts", "prefix"}


def test_detection_counts_what_is_honoured_not_what_is_accepted():
    """A lenient server ignoring n, log-probabilities, token ids, prompt log-probabilities and
    guided decoding answers 200 to all of them; detection sees they had no effect."""
    off = FakeFeatures(n=False, logprobs=False, token_ids=False, prompt_logprobs=False, echo=False, guided=False,
                       response_format=False, continuous_usage=False)
    fake = FakeOpenAI(features=off)
    with serve_app(fake.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        f = g.features
        assert not (f.n or f.logprobs or f.chat_logprobs or f.token_ids or f.prompt_logprobs or f.echo or f.guided
                    or f.response_format or f.continuous_usage)
        assert f.seed and f.tokenize and f.token_prompts  # these did work
        assert "score" not in g.capabilities.features and "logprobs" not in g.capabilities.features
        assert g.capabilities.constraints == frozenset()
        assert len(fake.log) <= 16  # start-up costs a handful of one-token requests


def test_detection_on_a_strict_minimal_server():
    fake = FakeOpenAI(features=FakeFeatures.minimal())
    with serve_app(fake.app) as url, RemoteGenerator(url + "/v1", "fake-model", retry=FAST) as g:  # either URL form
        f = g.features
        assert f.strict and f.n and f.logprobs and f.seed and f.response_format
        assert not (f.extras or f.token_ids or f.prompt_logprobs or f.echo or f.token_prompts or f.guided or f.tokenize)
        assert g.capabilities.features == {"logprobs", "stream"}
        assert g.capabilities.constraints == {"json_schema"}


# --- requests to bodies, answers to completions ------------------------------------------------------

def test_sampling_params_map_to_openai_and_vllm_fields(vllm):
    fake, g = vllm
    p = SamplingParams(temperature=0.3, top_p=0.9, max_tokens=7, stop=("x", "yz"), seed=4, presence_penalty=0.5,
                       frequency_penalty=0.25, logit_bias={5: 1.5}, n=2, top_k=3, min_p=0.1, repetition_penalty=1.2,
                       include_stop_str_in_output=True, ignore_eos=True)
    g.generate([Request("hi", p)], ledger=Ledger())
    assert last(fake) == {"model": "fake-model", "prompt": "hi", "temperature": 0.3, "top_p": 0.9, "max_tokens": 7,
                          "stop": ["x", "yz"], "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"5": 1.5},
                          "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2, "include_stop_str_in_output": True,
                          "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, "n": 2, "seed": 4}


@pytest.mark.parametrize(("spec", "field", "value"), [
    (ConstraintSpec.json_schema({"type": "object"}), "guided_json", {"type": "object"}),
    (ConstraintSpec.regex("[ab]+"), "guided_regex", "[ab]+"),
    (ConstraintSpec.choices(["yes", "no"]), "guided_choice", ["yes", "no"]),
    (ConstraintSpec.lark('start: "a"'), "guided_grammar", 'start: "a"'),
])
def test_constraints_map_to_vllms_structured_outputs_where_guided_fields_are_gone(spec, field, value):
    """vLLM >= 0.11 ignores ``guided_*`` (with a warning) and reads ``structured_outputs``."""
    new = FakeOpenAI(replies=REPLIES, features=FakeFeatures(guided=False, structured_outputs=True))
    with serve_app(new.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as gen:
        assert gen.features.structured_outputs and not gen.features.guided
        gen.generate([Request("hi", SamplingParams(max_tokens=4), constraint=spec)], ledger=Ledger())
        key = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}[field]
        assert last(new)["structured_outputs"] == {key: value} and field not in last(new)


@pytest.mark.parametrize(("spec", "field", "value"), [
    (ConstraintSpec.json_schema({"type": "object"}), "guided_json", {"type": "object"}),
    (ConstraintSpec.regex("[ab]+"), "guided_regex", "[ab]+"),
    (ConstraintSpec.choices(["yes", "no"]), "guided_choice", ["yes", "no"]),
    (ConstraintSpec.lark('start: "a"'), "guided_grammar", 'start: "a"'),
])
def test_constraints_map_to_vllm_guided_fields(vllm, spec, field, value):
    fake, g = vllm
    out = g.generate([Request("hi", SamplingParams(max_tokens=12), constraint=spec)], ledger=Ledger())[0][0]
    assert last(fake)[field] == value
    if spec.kind == "choices":
        assert out.text == "yes"


def test_each_prompt_kind_takes_its_route(vllm):
    fake, g = vllm
    ledger = Ledger()
    chat = g.generate([Request.chat("hi", SamplingParams(temperature=0))], ledger=ledger)[0][0]
    assert chat.text == "chat reply" and last(fake, "/v1/chat/completions")["messages"] == [{"role": "user", "content": "hi"}]
    assert last(fake, "/v1/chat/completions")["logprobs"] is True
    ids = g.generate([Request(TokenIds((104, 105)))], ledger=ledger)[0][0]
    assert ids.text == "hello" and last(fake)["prompt"] == [104, 105]
    # a prefix continues exactly: the prompt's ids (the server's /tokenize), then the prefix's
    cont = g.generate([Request("hi", prefix=(104, 101))], ledger=ledger)[0][0]
    assert last(fake)["prompt"] == [104, 105, 104, 101]
    assert fake.bodies("/tokenize")[-1] == {"model": "fake-model", "prompt": "hi", "add_special_tokens": True}
    assert cont.text == "ok"  # the fake's answer to a prompt it has no reply for
    chat_cont = g.generate([Request(({"role": "user", "content": "hi"},), prefix=(99,))], ledger=ledger)[0][0]
    assert last(fake)["prompt"] == [ord(c) for c in "<|user|>hi\n<|assistant|>"] + [99] and chat_cont.finish_reason == "stop"
    with pytest.raises(Unsupported, match="prefix with presence"):  # the server would count the prefix as prompt
        g.generate([Request("hi", SamplingParams(presence_penalty=0.5), prefix=(104,))], ledger=Ledger())


def test_a_streamed_n_is_charged_the_servers_total_not_per_choice_running_counts(vllm):
    """vLLM's continuous usage counts each choice's own tokens; only the last, choice-less chunk has
    the request's total. Charged: exactly that total, whole stream or not."""
    _, g = vllm
    request = Request("hi", SamplingParams(temperature=1.0, seed=2, n=3))
    ledger = Ledger()
    chunks = list(g.stream(request, ledger=ledger))
    tokens = sum(len(c.token_ids) for c in chunks)
    whole = g.generate([request], ledger=Ledger())[0]
    assert tokens == sum(len(c.token_ids) for c in whole) and ledger.usage.output_tokens == tokens
    fake, _ = vllm
    fake.stream_delay = 0.05  # a stream closed after 4 chunks, long before the server's total
    try:
        early = Ledger()
        stream = g.stream(request, ledger=early)
        got = [next(stream) for _ in range(4)]
        stream.close()
    finally:
        fake.stream_delay = 0.0
    # what arrived (a chunk or two may be in flight past what was read), never per-choice counts summed
    assert sum(len(c.token_ids) for c in got) <= early.usage.output_tokens <= 6 < tokens
    assert early.usage.input_tokens > 0


def test_greedy_n_asks_once_and_gives_n_identical_samples(vllm):
    """vLLM refuses n > 1 with temperature 0; the engine gives n identical samples: one request,
    its one answer under every index, charged once."""
    fake, g = vllm
    ledger = Ledger()
    before = fake.count()
    out = g.generate([Request("hi", SamplingParams(temperature=0, n=3))], ledger=ledger)[0]
    assert fake.count() == before + 1 and last(fake).get("n", 1) == 1
    assert [c.text for c in out] == ["hello"] * 3 and ledger.usage.output_tokens == len(out[0].token_ids)
    chunks = list(g.stream(Request("hi", SamplingParams(temperature=0, n=2)), ledger=Ledger()))
    assert {c.index for c in chunks} == {0, 1}
    assert "".join(c.text for c in chunks if c.index == 0) == "".join(c.text for c in chunks if c.index == 1) == "hello"


def test_answers_carry_ids_logprobs_finish_and_stop_reason(vllm):
    _, g = vllm
    full, stopped, cut = (g.generate([Request("hi", SamplingParams(**kw))], ledger=Ledger())[0][0] for kw in (
        {}, {"stop": ("ll",)}, {"max_tokens": 3}))
    assert full.token_ids == (104, 101, 108, 108, 111, 0) and full.logprobs == tuple(logprob(t) for t in full.token_ids)
    # vLLM says null at end-of-sequence; the completion names the end token, as the local engine's do
    assert (full.text, full.finish_reason, full.stop_reason) == ("hello", "stop", 0)
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason, stopped.token_ids) == ("he", "stop", "ll",
                                                                                           (104, 101, 108, 108))
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("hel", "length", None)


class LetterTokenizer:
    """A local tokenizer matching the fake's: one token per character, its code point."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        return chat_template(messages, add_generation_prompt)


def test_a_local_tokenizer_fills_in_what_the_server_has_no_route_for():
    fake = FakeOpenAI(features=FakeFeatures.minimal(), replies=REPLIES)
    with serve_app(fake.app) as url:
        with RemoteGenerator(url, "fake-model", retry=FAST) as bare:
            out = bare.generate([Request("hi")], ledger=Ledger())[0][0]
            assert out.token_ids == () and len(out.logprobs) == 6 and "token_ids" not in bare.capabilities.features
        with RemoteGenerator(url, "fake-model", retry=FAST, tokenizer=LetterTokenizer()) as g:
            assert {"token_ids", "render"} <= g.capabilities.features
            assert g.generate([Request("hi")], ledger=Ledger())[0][0].token_ids == (104, 101, 108, 108, 111)
            assert g.render([{"role": "user", "content": "x"}]) == "<|user|>x\n<|assistant|>"


def test_a_tokenizer_folder_gives_the_chat_template_and_output_ids():
    from metaloom.models.engine.tokenizer import HFTokenizer
    from metaloom.models.find import resolve

    folder = resolve("default")[1]  # the default model is part of the install: its absence is a failure
    fake = FakeOpenAI(features=FakeFeatures.minimal(), replies={"hi": ["Hello there!"]})
    with serve_app(fake.app) as url, RemoteGenerator(url, "fake-model", retry=FAST, tokenizer=folder) as g:
        tok = HFTokenizer(folder)
        messages = [{"role": "user", "content": "hi"}]
        assert g.render(messages) == tok.apply_chat_template(messages)
        assert g.generate([Request("hi")], ledger=Ledger())[0][0].token_ids == tuple(tok.encode("Hello there!", False))


# --- score, render, stream -------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_logprobs", [True, False], ids=["prompt_logprobs", "echo"])
def test_score_reads_the_continuations_prompt_logprobs(prompt_logprobs):
    fake = FakeOpenAI(features=FakeFeatures(prompt_logprobs=prompt_logprobs))
    with serve_app(fake.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        ledger = Ledger()
        scored = g.score("hi", [" there", TokenIds((65, 66))], ledger=ledger)
        assert [s.text for s in scored] == [" there", "AB"]
        assert scored[0].token_ids == tuple(map(ord, " there")) and scored[1].token_ids == (65, 66)
        assert [s.logprobs for s in scored] == [tuple(logprob(ord(c)) for c in s.text) for s in scored]
        body = last(fake)
        assert body["prompt"] == [[104, 105, *map(ord, " there")], [104, 105, 65, 66]]  # one batched request
        assert ("prompt_logprobs" in body) == prompt_logprobs and body.get("echo", False) != prompt_logprobs
        assert ledger.usage.input_tokens == 8 + 4 and ledger.usage.output_tokens == 2  # what the server computed
        chat = g.score(({"role": "user", "content": "hi"},), ["yes"], ledger=ledger)[0]
        assert chat.token_ids == (121, 101, 115) and chat.logprob == pytest.approx(sum(logprob(t) for t in b"yes"))


def test_render_goes_through_the_servers_template(vllm):
    fake, g = vllm
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert g.render(messages) == chat_template(messages)
    assert fake.bodies("/tokenize")[-1]["add_generation_prompt"] is True and fake.bodies("/detokenize")


def test_stream_chunks_join_to_the_generated_samples_and_usage_is_charged_once(vllm):
    fake, g = vllm
    request = Request("hi", SamplingParams(n=2, seed=0))
    fake.seen_prompts.clear()
    whole_ledger, stream_ledger = Ledger(), Ledger()
    whole = g.generate([request], ledger=whole_ledger)[0]
    fake.seen_prompts.clear()
    chunks = list(g.stream(request, ledger=stream_ledger))
    for i, c in enumerate(whole):
        mine = [k for k in chunks if k.index == i]
        assert "".join(k.text for k in mine) == c.text and sum((k.token_ids for k in mine), ()) == c.token_ids
        assert sum((k.logprobs for k in mine), ()) == c.logprobs and mine[-1].finish_reason == c.finish_reason
    for field in ("input_tokens", "cached_tokens", "output_tokens"):
        assert getattr(stream_ledger.usage, field) == getattr(whole_ledger.usage, field)
    assert last(fake)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


# --- against metaloom serve ----------------------------------------------------------------------------

class FirstLetter:
    """Votes by the first character (the tiny model writes random letters)."""

    name = "first-letter"

    def extract(self, text: str) -> str | None:
        return text[:1] or None

    def same(self, a: str, b: str) -> bool:
        return a == b


@pytest.fixture(scope="module")
def metaloom_serve():
    """The tiny model twice: a LocalGenerator, and metaloom serve (its own copy) behind a RemoteGenerator."""
    app = create_app(LocalGenerator(tiny_llama()), model_ids=["default"])
    with serve_app(app) as url, RemoteGenerator(url, "default", retry=FAST) as remote:
        yield LocalGenerator(tiny_llama()), remote, url


def spent(ledger: Ledger) -> Usage:
    u = ledger.usage
    return Usage(input_tokens=u.input_tokens, cached_tokens=u.cached_tokens, output_tokens=u.output_tokens,
                 forward_passes=u.forward_passes, flops=u.flops, scorer_calls=u.scorer_calls)


def test_metaloom_serve_is_detected_as_serving_everything_it_does(metaloom_serve):
    _, remote, _ = metaloom_serve
    f = remote.features
    assert f.strict and f.n and f.seed and f.token_ids and f.top_logprobs and f.prompt_logprobs and f.echo
    assert f.token_prompts and f.guided and f.tokenize and f.tokenize_chat and f.detokenize and f.exact_usage
    assert remote.capabilities.sampling == SAMPLING_FIELDS  # a strict server: every field it accepts is served
    assert remote.capabilities.features == {"token_ids", "logprobs", "score", "render", "stream", "token_prompts", "prefix"}
    assert remote.accounting["forward_passes"] == remote.accounting["flops"] == "exact (server)"


SAMPLED = SamplingParams(temperature=0.8, seed=3, max_tokens=6)


@pytest.mark.parametrize("request_", [
    Request("hello", SamplingParams(temperature=0, max_tokens=8)),
    Request("hello", SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, top_logprobs=2)),
    Request(({"role": "user", "content": "abc"},), SamplingParams(temperature=0.9, seed=1, n=2, max_tokens=5)),
    Request("hello", SamplingParams(temperature=0, max_tokens=12, stop=("b",))),
    Request(TokenIds((7, 4, 11, 11, 14)), SAMPLED),
    Request("hello", SAMPLED, prefix=(1, 2, 3)),
    Request("hello", SamplingParams(temperature=0.7, seed=2, top_k=3, min_p=0.05, repetition_penalty=1.3, max_tokens=6)),
    Request("hello", SamplingParams(temperature=0, max_tokens=6), constraint=ConstraintSpec.choices(["abc", "xyz"])),
], ids=["greedy", "seeded-n-top", "chat", "stop", "token-ids", "prefix", "vllm-extras", "choices"])
def test_generate_through_metaloom_serve_equals_local(metaloom_serve, request_):
    local, remote, _ = metaloom_serve
    local_ledger, remote_ledger = Ledger(), Ledger()
    mine = local.generate([request_], ledger=local_ledger)[0]
    theirs = remote.generate([request_], ledger=remote_ledger)[0]
    for a, b in zip(mine, theirs, strict=True):
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason, a.stop_reason)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert (b.top_logprobs is None) == (a.top_logprobs is None)
        for x, y in zip(a.top_logprobs or (), b.top_logprobs or (), strict=True):
            assert [t for t, _ in y] == [t for t, _ in x] and [v for _, v in y] == pytest.approx([v for _, v in x], abs=1e-5)
    assert spent(remote_ledger) == spent(local_ledger)  # exact usage: tokens, forward passes, FLOPs


def strategies():
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=6)
    return [
        MajorityVote(n=5, extractor=FirstLetter(), params=sampled),
        BestOfN(n=4, scorer=SequenceLogprob(normalize=True), params=sampled),
        MBR(n=4, params=sampled),
        AdaptiveVote(batch=2, min_samples=2, max_samples=6, rule="share", threshold=0.6, extractor=FirstLetter(),
                     params=sampled),
        PrunedBestOfN(n=4, chunk_tokens=3, keep_fraction=0.5, max_tokens=9, params=sampled),
        FirstFinish(n=3, chunk_tokens=2, max_tokens=8, params=SamplingParams(temperature=0.8, seed=5, stop=("x",))),
    ]


@pytest.mark.parametrize("strategy", strategies(), ids=lambda s: type(s).__name__)
def test_strategies_through_metaloom_serve_equal_local(metaloom_serve, strategy):
    local, remote, _ = metaloom_serve
    local_ledger, remote_ledger = Ledger(), Ledger()
    mine = strategy.run("hello", local, ledger=local_ledger)
    theirs = strategy.run("hello", remote, ledger=remote_ledger)
    assert (theirs.best, theirs.best_index, theirs.answers) == (mine.best, mine.best_index, mine.answers)
    assert [c.text for c in theirs.candidates] == [c.text for c in mine.candidates]
    assert theirs.scores == pytest.approx(mine.scores, abs=1e-4)
    assert [e.kind for e in theirs.trace] == [e.kind for e in mine.trace]
    # the tokens are the same; forward passes too, except where the engine batched several requests
    # of one call into shared steps (each request is its own HTTP call, its own steps, remotely)
    for field in ("input_tokens", "output_tokens", "scorer_calls"):
        assert getattr(theirs.usage, field) == getattr(mine.usage, field), field


def bound_strategies():
    """The other registered strategies (and the scorers that ask the generator), built for one
    side's generator; every template in letters, all the tiny model's tokenizer knows."""
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=6)
    return {
        "weighted_vote": lambda gen: WeightedVote(scorer=SequenceLogprob(), n=4, extractor=FirstLetter(), transform="exp",
                                                  params=sampled),
        "best_of_n+judge": lambda gen: BestOfN(n=3, params=sampled, scorer=LLMJudge(
            generator=gen, template="{prompt}{candidate}q", yes="y", no="n")),
        "budget_forcing": lambda gen: BudgetForcing(min_thinking_tokens=4, max_thinking_tokens=8, answer_max_tokens=4,
                                                    think_start="t", think_end="e", wait="w", answer_prefix="f",
                                                    params=SamplingParams(temperature=0.0, max_tokens=8)),
        "chain": lambda gen: Chain(steps=("{prompt}a", "{prompt}{step1}b"), max_tokens=(6, 4)),
        "refine": lambda gen: Refine(rounds=2, params=sampled, revise_template="{feedback}r", feedback=CritiqueFeedback(
            generator=gen, template="{prompt}{candidate}k", ok_marker="zzz", max_tokens=4)),
    }


@pytest.mark.parametrize("name", sorted(bound_strategies()))
def test_the_other_strategies_through_metaloom_serve_equal_local(metaloom_serve, name):
    """With the six above: every registered strategy, and every scorer that asks the generator,
    runs unchanged remotely (the README's table)."""
    local, remote, _ = metaloom_serve
    make = bound_strategies()[name]
    prompt = ({"role": "user", "content": "hello"},) if name == "refine" else "hello"  # a chat: no newlines
    mine = make(local).run(prompt, local, ledger=Ledger())
    theirs = make(remote).run(prompt, remote, ledger=Ledger())
    assert mine.stopped_reason is None and len(mine.trace) > 1
    assert (theirs.best, theirs.best_index, theirs.answers) == (mine.best, mine.best_index, mine.answers)
    assert [c.text for c in theirs.candidates] == [c.text for c in mine.candidates]
    assert theirs.scores == pytest.approx(mine.scores, abs=1e-4)
    assert [e.kind for e in theirs.trace] == [e.kind for e in mine.trace]


def test_score_render_and_stream_through_metaloom_serve_equal_local(metaloom_serve):
    local, remote, _ = metaloom_serve
    conts = ["abc", "b", TokenIds((1, 2, 3))]
    for prompt in ("hello", ({"role": "user", "content": "hi"},)):
        mine, theirs = local.score(prompt, conts, ledger=Ledger()), remote.score(prompt, conts, ledger=Ledger())
        for a, b in zip(mine, theirs, strict=True):
            assert (b.text, b.token_ids) == (a.text, a.token_ids) and b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]
    assert remote.render(messages) == local.render(messages)
    request = Request("hello", SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=5))
    assert [(c.text, c.token_ids, c.index, c.finish_reason) for c in remote.stream(request, ledger=Ledger())] == \
        [(c.text, c.token_ids, c.index, c.finish_reason) for c in local.stream(request, ledger=Ledger())]


def test_first_finish_streaming_through_metaloom_serve_frees_the_servers_rows(metaloom_serve):
    local, remote, url = metaloom_serve
    strategy = FirstFinish(n=3, mode="stream", max_tokens=200, params=SamplingParams(temperature=0.8, seed=5, stop=("x",)))
    mine = strategy.run("hello", local, ledger=Ledger())
    theirs = strategy.run("hello", remote, ledger=Ledger())
    assert (theirs.best, theirs.best_index) == (mine.best, mine.best_index)
    assert [c.finish_reason for c in theirs.candidates] == [c.finish_reason for c in mine.candidates]
    assert sorted(c.finish_reason for c in theirs.candidates) == ["cancelled", "cancelled", "stop"]
    deadline = time.monotonic() + 10
    while httpx.get(url + "/health").json()["running_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").json()["running_rows"] == 0  # the losers were cancelled on the server
    # no final usage for a closed stream: charged the prompt and the tokens that had arrived
    assert theirs.usage.input_tokens == mine.usage.input_tokens == 5
    assert theirs.usage.output_tokens >= sum(len(c.token_ids) for c in theirs.candidates)


def tree_searches():
    """Tree search, step scorer and all, through a server: each round's frontier goes as token-id
    prefixes (exact continuation), the judge's questions as scored prompts."""
    from metaloom.score.step_judge import StepJudge
    from metaloom.search.beam import StepBeamSearch
    from metaloom.search.mcts import MCTS
    from metaloom.search.particle import ParticleFiltering
    from metaloom.search.rebase import Rebase

    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12)
    common = {"delimiter": ("a",), "step_tokens": 4, "params": params}

    def judge(gen):
        return StepJudge(gen, template="{prompt}{step}q", yes="y", no="n")

    return {
        "step_beam_search": lambda gen: StepBeamSearch(step_scorer=judge(gen), n=4, beam_width=2, **common),
        "rebase": lambda gen: Rebase(step_scorer=judge(gen), n=3, **common),
        "mcts": lambda gen: MCTS(step_scorer=judge(gen), iterations=3, k=2, **common),
        "particle_filtering": lambda gen: ParticleFiltering(step_scorer=judge(gen), n=3, **common),
    }


@pytest.mark.parametrize("name", sorted(tree_searches()))
def test_tree_search_through_metaloom_serve_equals_local(metaloom_serve, name):
    local, remote, _ = metaloom_serve
    make = tree_searches()[name]
    mine = make(local).run("hello", local, ledger=Ledger())
    theirs = make(remote).run("hello", remote, ledger=Ledger())
    tree = lambda r: next(e.data for e in r.trace if e.kind == "tree")  # noqa: E731
    assert len(tree(mine)["nodes"]) > 3
    assert [(n["text"], n["parent"], n["state"]) for n in tree(theirs)["nodes"]] == \
        [(n["text"], n["parent"], n["state"]) for n in tree(mine)["nodes"]]
    assert (theirs.best, theirs.best_index) == (mine.best, mine.best_index)
    assert theirs.scores == pytest.approx(mine.scores, abs=1e-4)
    assert theirs.usage.scorer_calls == mine.usage.scorer_calls
    # the expansions cost the same tokens; scoring a judge's question remotely costs more (a
    # scoring request generates one token; see README "Remote servers")
    expanded = lambda r: [(c["id"], c["finish"]) for e in r.trace if e.kind == "expand" for c in e.data["children"]]  # noqa: E731
    assert expanded(theirs) == expanded(mine)
    assert theirs.usage.input_tokens >= mine.usage.input_tokens
