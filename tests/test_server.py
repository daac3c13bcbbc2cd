"""`metaloom serve` through the official `openai` client, on the real default model, on loopback:
the same text as offline generation, streaming that joins to the non-streamed text, 64 concurrent
clients each getting its own answer, cancellation that frees rows, strategies per request,
errors in OpenAI's shape with the right status, auth, metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time

import httpx2 as httpx  # the HTTP client the openai package itself uses (openai >= 3)
import openai
import pytest

from metaloom.generator import LocalGenerator, Request
from metaloom.generator.plan import encode
from metaloom.ledger import Ledger
from metaloom.prefix import PrefixCache
from metaloom.sampling import SamplingParams
from metaloom.server.app import create_app
from metaloom.testing.served import serve_app

KEY = "test-key"


class Served:
    def __init__(self, app, port: int) -> None:
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"

    def client(self, key: str | None = None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=120, **kw)

    def async_client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=300)


@contextlib.contextmanager
def serving(generator, **kw):
    app = create_app(generator, model_ids=["default"], **kw)
    with serve_app(app) as url:
        yield Served(app, int(url.rsplit(":", 1)[1]))


@pytest.fixture(scope="module")
def served(smollm):
    with serving(LocalGenerator(smollm, prefix_cache=PrefixCache(budget_bytes=256 << 20))) as s:
        yield s


@pytest.fixture(scope="module")
def secured(smollm):
    with serving(LocalGenerator(smollm), api_key=KEY) as s:
        yield s


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _offline(smollm_generator, messages, **params) -> list:
    request = Request(tuple(messages), SamplingParams(**params))
    return smollm_generator.generate([request], ledger=Ledger())[0]


# --- the request honoured ----------------------------------------------------------------------

def test_chat_greedy_equals_offline_generation_with_usage_and_logprobs(served, smollm_generator):
    messages = _chat("Name three fruits.")
    r = served.client().chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0,
                                                logprobs=True)
    expected = _offline(smollm_generator, messages, temperature=0, max_tokens=20)[0]
    choice = r.choices[0]
    assert choice.message.content == expected.text and choice.finish_reason == expected.finish_reason
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(expected.logprobs), abs=1e-4)
    assert r.usage.completion_tokens == len(expected.token_ids)
    assert r.usage.prompt_tokens == len(encode(smollm_generator, tuple(messages)))
    extra = r.usage.model_extra["metaloom"]
    assert extra["forward_passes"] == len(expected.token_ids) and extra["flops"] > 0


@pytest.mark.parametrize("chat", [True, False])
def test_stream_chunks_join_to_the_non_streamed_text_for_the_same_seed(served, chat):
    c = served.client()
    args = dict(model="default", max_tokens=24, temperature=0.9, seed=7, n=2)
    if chat:
        whole = c.chat.completions.create(messages=_chat("Tell me about owls."), **args)
        texts = {ch.index: ch.message.content for ch in whole.choices}
        stream = c.chat.completions.create(messages=_chat("Tell me about owls."), stream=True,
                                           stream_options={"include_usage": True}, **args)
    else:
        whole = c.completions.create(prompt="Owls are", **args)
        texts = {ch.index: ch.text for ch in whole.choices}
        stream = c.completions.create(prompt="Owls are", stream=True, stream_options={"include_usage": True}, **args)
    parts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for ch in chunk.choices:
            parts[ch.index] += (ch.delta.content or "") if chat else ch.text
            if ch.finish_reason is not None:
                finishes[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert parts == texts and texts[0] != texts[1]  # two different samples, each joined exactly
    assert finishes == {ch.index: ch.finish_reason for ch in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_completions_take_a_batch_of_prompts_and_token_ids(served, smollm_generator):
    tok = smollm_generator.tokenizer
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    r = served.client().completions.create(model="default", prompt=["The capital of France is", "1, 2, 3,"], n=1,
                                           max_tokens=6, temperature=0)
    by_ids = served.client().completions.create(model="default", prompt=ids, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert by_ids.choices[0].text == r.choices[0].text  # the same prompt, as text and as its token ids


def test_top_logprobs_name_the_offline_top_tokens_streamed_or_not(served, smollm_generator):
    messages = _chat("Say something about the sea.")
    r = served.client().chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3)
    offline = _offline(smollm_generator, messages, temperature=0, max_tokens=8, top_logprobs=3)[0]
    tok = smollm_generator.tokenizer
    content = r.choices[0].logprobs.content
    assert len(content) == len(offline.token_ids)
    for entry, top in zip(content, offline.top_logprobs, strict=True):
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t, _ in top]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([lp for _, lp in top], abs=1e-4)
    streamed = []
    for chunk in served.client().chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                                         logprobs=True, top_logprobs=3, stream=True):
        for ch in chunk.choices:
            streamed += [[(a.token, a.logprob) for a in e.top_logprobs] for e in (ch.logprobs.content if ch.logprobs else [])]
    whole = [[(a.token, a.logprob) for a in e.top_logprobs] for e in content]
    assert [[t for t, _ in top] for top in streamed] == [[t for t, _ in top] for top in whole]
    # the second call reads the prompt from the prefix cache: the same values up to float rounding
    assert [lp for top in streamed for _, lp in top] == pytest.approx([lp for top in whole for _, lp in top], abs=1e-4)


def test_echo_and_prompt_logprobs_score_the_prompt_as_the_engine_does(served, smollm_generator):
    tok = smollm_generator.tokenizer
    prompt = "The capital of France is Paris"
    ids, positions = smollm_generator.prompt_logprobs(prompt, 2, ledger=Ledger())
    r = served.client().completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2)
    choice = r.choices[0]
    plain = served.client().completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0)
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([p.logprob for p in positions], abs=1e-4)
    assert all(len(m) <= 2 for m in lp.top_logprobs[1:])
    assert r.usage.prompt_tokens == len(ids)  # read twice (scored, then prefilled), counted once
    # OpenAI's scoring call: echo, nothing generated
    only = served.client().completions.create(model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ids)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    # vLLM's prompt_logprobs: the prompt token with its rank, then the most likely ones; tokens as exact ids
    v = _post(served, {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
                       "logprobs": 1, "return_tokens_as_token_ids": True}, path="/v1/completions").json()["choices"][0]
    assert v["prompt_logprobs"][0] is None and len(v["prompt_logprobs"]) == len(ids)
    for entry, p in zip(v["prompt_logprobs"][1:], positions, strict=True):
        assert entry[str(p.token)]["rank"] == p.rank and entry[str(p.token)]["logprob"] == pytest.approx(p.logprob, abs=1e-4)
        assert {int(t) for t in entry} == {p.token} | {t for t, _ in p.top}
    assert v["text"] == plain.choices[0].text[:len(v["text"])] and v["logprobs"]["tokens"][0].startswith("token_id:")


def test_tokenize_and_detokenize_as_vllm_shapes_them(served, smollm_generator):
    messages = _chat("Hello there")
    chat = _post(served, {"model": "default", "messages": messages}, path="/tokenize").json()
    assert chat["tokens"] == encode(smollm_generator, tuple(messages)) and chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] == smollm_generator.model.max_context
    text = _post(served, {"model": "default", "prompt": "Hello there", "return_token_strs": True}, path="/tokenize").json()
    assert text["tokens"] == smollm_generator.tokenizer.encode("Hello there") and "".join(text["token_strs"]) == "Hello there"
    back = _post(served, {"model": "default", "tokens": chat["tokens"]}, path="/detokenize").json()["prompt"]
    assert back == smollm_generator.render(tuple(messages))
    assert _post(served, {"model": "default", "tokens": [10**9]}, path="/detokenize").json()["error"]["param"] == "tokens"
    assert _post(served, {"model": "gpt-9", "prompt": "x"}, path="/tokenize").status_code == 404
    assert _post(served, {"model": "default"}, path="/tokenize").status_code == 400


def test_continuous_usage_counts_each_choices_tokens_so_far_as_vllm_does(served):
    seen: dict[int, list[int]] = {0: [], 1: []}
    total = None
    for chunk in served.client().completions.create(model="default", prompt="Count: one, two,", max_tokens=6,
                                                    temperature=1.0, seed=3, n=2, stream=True, extra_body={"ignore_eos": True},
                                                    stream_options={"include_usage": True, "continuous_usage_stats": True}):
        for ch in chunk.choices:
            seen[ch.index].append(chunk.usage.completion_tokens)
        if not chunk.choices:
            total = chunk.usage
    assert all(s == list(range(1, 7)) for s in seen.values())  # one token a chunk, per choice
    assert total is not None and total.completion_tokens == 12  # the request's total, in the last chunk


def test_a_failed_upstream_is_502_and_a_silent_one_504():
    from metaloom.errors import RemoteError, RemoteTimeout
    from metaloom.server.errors import api_error

    assert api_error(RemoteError("http://judge", "boom", 500)).status == 502
    assert api_error(RemoteTimeout("http://judge", "no answer")).status == 504


def test_vllms_structured_outputs_constrain_as_guided_fields_do(served):
    r = _post(served, {"model": "default", "prompt": "Is the sky blue?", "max_tokens": 5, "temperature": 0,
                       "structured_outputs": {"choice": ["maybe", "certainly"]}}, path="/v1/completions").json()
    assert r["choices"][0]["text"] in ("maybe", "certainly")
    bad = _post(served, {"model": "default", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
                path="/v1/completions")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"


def test_response_format_json_schema_is_enforced(served):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = served.client().chat.completions.create(
        model="default", messages=_chat("Invent a person."), max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_two_requests_with_one_system_prompt_prefill_it_once(served):
    system = "You are a terse assistant. " * 20
    c = served.client()
    first = c.chat.completions.create(model="default", messages=[{"role": "system", "content": system}, *_chat("Hi")],
                                      max_tokens=4, temperature=0)
    second = c.chat.completions.create(model="default", messages=[{"role": "system", "content": system}, *_chat("Bye")],
                                       max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 100  # the system prompt's tokens came from the cache
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


# --- continuous batching -------------------------------------------------------------------------

def test_64_concurrent_clients_each_get_their_own_answer(served, smollm_generator):
    prompts = [f"Write the number {i} in words." for i in range(64)]
    expected = [_offline(smollm_generator, _chat(p), temperature=0, max_tokens=10)[0].text for p in prompts]

    async def ask(client, p):
        r = await client.chat.completions.create(model="default", messages=_chat(p), max_tokens=10, temperature=0)
        return r.choices[0].message.content

    async def everyone():
        client = served.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(ask(client, p) for p in prompts)), timeout=600)
        finally:
            await client.close()

    steps_before = served.app.state.scheduler.steps
    got = asyncio.run(everyone())
    assert got == expected  # every response correct and to the client that asked
    # and they were batched: far fewer steps than 64 requests decoded one after another
    assert served.app.state.scheduler.steps - steps_before < 64 * 10 // 4


def test_a_client_that_goes_away_frees_its_rows(served):
    sched = served.app.state.scheduler
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": _chat("Write a long story."), "max_tokens": 2000,
                            "temperature": 0.8, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert sched.stats().running_rows == 1
    deadline = time.monotonic() + 20
    while sched.stats().running_rows and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sched.stats().running_rows == 0  # cancelled long before its 2,000 tokens


def test_a_cancelled_streams_tokens_are_counted_in_the_metrics(served):
    """The rows a client abandoned generated tokens all the same: they are in
    metaloom_completion_tokens_total (they were missing)."""
    def completed() -> float:
        text = httpx.get(served.url + "/metrics").text
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("metaloom_completion_tokens_total "))

    before = completed()
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=60,
                      json={"model": "default", "messages": _chat("Write a long story."), "max_tokens": 2000,
                            "temperature": 0.8, "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        got = [line for line in (next(lines) for _ in range(12)) if line.startswith("data: ")]
    deadline = time.monotonic() + 20
    while completed() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert completed() - before >= len(got) - 1  # at least the tokens it streamed before going away


# --- strategies per request ----------------------------------------------------------------------

def test_a_strategy_by_model_alias_and_by_metaloom_object(served):
    c = served.client()
    question = _chat("What is 2 + 3? Answer with a number.")
    by_alias = c.chat.completions.create(model="majority_vote@n=4:default", messages=question, max_tokens=16, seed=3)
    by_body = c.chat.completions.create(model="default", messages=question, max_tokens=16, seed=3,
                                        extra_body={"metaloom": {"strategy": "majority_vote", "params": {"n": 4},
                                                                 "trace": True}})
    for r in (by_alias, by_body):
        info = r.model_extra["metaloom"]
        assert info["strategy"] == "majority_vote" and len(info["candidates"]) == 4
        assert r.choices[0].message.content == info["candidates"][info["best_index"]]["text"]
        assert r.usage.completion_tokens == sum(cand["tokens"] for cand in info["candidates"])
    assert by_alias.choices[0].message.content == by_body.choices[0].message.content  # same seed, same run
    assert any(e["kind"] == "vote" for e in by_body.model_extra["metaloom"]["trace"])


def test_a_streamed_strategy_sends_progress_then_the_answer(served):
    stream = served.client().chat.completions.create(
        model="default", messages=_chat("Name a color."), max_tokens=8, stream=True, stream_options={"include_usage": True},
        extra_body={"metaloom": {"strategy": "best_of_n", "params": {"n": 3}}})
    events = list(stream)
    progress = [e.model_extra["metaloom"] for e in events if (e.model_extra or {}).get("metaloom", {}).get("event")]
    assert progress and progress[-1]["samples_finished"] == 3
    kinds = [p["trace"]["kind"] for p in progress if "trace" in p]
    assert kinds == ["sample", "score", "select"]  # the strategy's steps, live, in order
    text = "".join(ch.delta.content or "" for e in events for ch in e.choices)
    final = events[-1]
    assert final.usage is not None and text == final.model_extra["metaloom"]["candidates"][
        final.model_extra["metaloom"]["best_index"]]["text"]


def test_a_streamed_tree_search_sends_each_round_then_the_tree(served):
    stream = served.client().chat.completions.create(
        model="default", messages=_chat("Make 24 using 8, 5, 10, 6."), max_tokens=24, stream=True, seed=2,
        stream_options={"include_usage": True},
        extra_body={"metaloom": {"strategy": "step_beam_search", "trace": True,
                                 "params": {"step_scorer": "game24", "n": 2, "beam_width": 1, "step_tokens": 8}}})
    chunks = list(stream)
    events = [e.model_extra["metaloom"] for e in chunks if (e.model_extra or {}).get("metaloom", {}).get("event")]
    rounds = [e["trace"] for e in events if e.get("trace", {}).get("kind") == "expand"]
    assert rounds and [r["round"] for r in rounds] == list(range(len(rounds)))  # each round, live, in order
    report = chunks[-1].model_extra["metaloom"]
    tree = next(e for e in report["trace"] if e["kind"] == "tree")
    assert len(tree["rounds"]) == len(rounds) and tree["strategy"] == "step_beam_search"
    assert [c["id"] for r in rounds for c in r["children"]] == [n["id"] for n in tree["nodes"][1:]]


def test_a_streamed_vote_sends_the_votes_so_far_each_round(served):
    stream = served.client().chat.completions.create(
        model="default", messages=_chat("What is 2 + 2? Answer with a number."), max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"metaloom": {"strategy": "adaptive_vote",
                                 "params": {"batch": 2, "max_samples": 6, "min_samples": 6, "extractor": "last_number"}}})
    chunks = list(stream)
    events = [e.model_extra["metaloom"] for e in chunks if (e.model_extra or {}).get("metaloom", {}).get("event")]
    votes = [e for e in events if e.get("trace", {}).get("kind") == "vote"]
    assert len(votes) == 3  # one tally per round of 2 samples, sent as the round ends
    assert [v["samples_finished"] for v in votes] == [2, 4, 6]
    totals = [sum(v["trace"]["tally"].values()) for v in votes]  # samples with an answer so far
    assert all(t <= 2 * (i + 1) for i, t in enumerate(totals)) and totals == sorted(totals)
    report = chunks[-1].model_extra["metaloom"]
    final = collections.Counter(a for a in report["answers"] if a is not None)
    assert votes[-1]["trace"]["tally"] == {k: float(v) for k, v in final.items()}


def test_a_strategy_budget_stops_and_keeps_the_work(served):
    r = served.client().chat.completions.create(
        model="default", messages=_chat("Count to fifty."), max_tokens=64, seed=1,
        extra_body={"metaloom": {"strategy": "majority_vote", "params": {"n": 4}, "budget": {"output_tokens": 40}}})
    info = r.model_extra["metaloom"]
    assert info["stopped_reason"] is not None and info["candidates"]
    assert r.usage.completion_tokens <= 40 + 4  # the step that crossed the limit, at most one token per row


# --- errors in OpenAI's shape ----------------------------------------------------------------------

def _post(served, body, headers=None, path="/v1/chat/completions"):
    # JSON with ASCII escapes, as most clients send it: a lone surrogate travels as "\ud800"
    return httpx.post(served.url + path, content=json.dumps(body),
                      headers={"content-type": "application/json", **(headers or {})}, timeout=60)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "default", "messages": _chat("x"), "functions": [{"name": "f"}]}, 400, "functions"),  # tools' forerunner
    ({"model": "default", "messages": _chat("x"), "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "default", "messages": _chat("x"), "temperature": -1}, 400, "temperature"),
    ({"model": "default", "messages": _chat("x"), "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "default", "messages": []}, 400, "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content[0]"),
    ({"model": "default", "messages": _chat("x"), "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "default", "messages": _chat("x"), "max_tokens": 100000}, 400, None),  # past the context window
    ({"model": "default", "messages": _chat("x"), "metaloom": {"strategy": "majority_vote", "params": {"n": 0}}}, 400,
     "metaloom.params.n"),
    ({"model": "default", "messages": _chat("x"), "metaloom": {"strategy": "nope"}}, 400, "metaloom.strategy"),
    ({"model": "gpt-9", "messages": _chat("x")}, 404, "model"),
    ({"model": "default", "messages": _chat("x"), "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": "default", "messages": _chat("x"), "top_logprobs": 2}, 400, "top_logprobs"),
    # were accepted (pydantic coerced them) or a 500 (issue 30)
    ({"model": "default", "messages": _chat("x"), "stream": "yes"}, 400, "stream"),
    ({"model": "default", "messages": _chat("x"), "n": "4"}, 400, "n"),
    ({"model": "default", "messages": _chat("x"), "logit_bias": {"5": 500}}, 400, "logit_bias[5]"),
    ({"model": "default", "messages": _chat("x"), "max_tokens": 8, "max_completion_tokens": 16}, 400,
     "max_completion_tokens"),
    ({"model": "default", "messages": _chat("x"), "seed": 2**63}, 400, "seed"),
    ({"model": "default", "messages": _chat("x"), "seed": -(2**70)}, 400, "seed"),
    ({"model": "default", "messages": _chat("x\ud800")}, 400, "messages[0].content"),
    ({"model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400,
     "messages[0].content[0].text"),
    ({"model": "default", "messages": _chat("x"), "stop": ["\ud83d"]}, 400, "stop[0]"),
])
def test_bad_requests_get_openai_errors_naming_the_field(served, body, status, param):
    r = _post(served, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # nothing to generate is only a scoring call with echo
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "metaloom": {"strategy": "majority_vote"}}, "echo"),
    ({"prompt": [1, 2, 3], "metaloom": {"strategy": "majority_vote", "params": {"n": 2}}}, "prompt"),  # no text
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ["ok", "\ud800"]}, "prompt[1]"),
])
def test_bad_completions_requests_name_the_field(served, body, param):
    r = _post(served, {"model": "default", **body}, path="/v1/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_lone_surrogate_to_tokenize_is_a_400_naming_the_field(served):
    for body, param in (({"prompt": "\ud800"}, "prompt"), ({"messages": _chat("\ud800")}, "messages[0].content")):
        r = _post(served, body, path="/tokenize")
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_the_server_still_takes_what_openai_clients_send(served):
    """Strict types refuse strings for numbers, not the numbers JSON has: an integer temperature,
    stop as a list, both max_tokens fields when they agree, a valid surrogate pair (an emoji)."""
    r = _post(served, {"model": "default", "messages": _chat("Say hi \ud83d\ude00"), "temperature": 0, "max_tokens": 4,
                       "max_completion_tokens": 4, "stop": ["\n\n"], "seed": 2**63 - 1, "logit_bias": {"5": -100}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 4


def test_an_oversized_body_is_413(served):
    r = _post(served, {"model": "default", "messages": _chat("x" * (5 << 20))})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_bug_is_a_500_that_tells_the_client_nothing(served, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(served.app.state.scheduler, "submit", broken)
    r = _post(served, {"model": "default", "messages": _chat("x")})
    assert r.status_code == 500 and "secret" not in r.text
    assert any("secret internals" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)


def test_overload_is_429_with_retry_after(smollm):
    with serving(LocalGenerator(smollm), max_rows=1, max_waiting=1) as s:
        body = {"model": "default", "messages": _chat("Write a poem."), "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(client.post(s.url + "/v1/chat/completions", json=body) for _ in range(6)))

        statuses = [r.status_code for r in asyncio.run(burst())]
        refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
    assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
    # derived from the queue (issue 30): whole seconds, at least one
    assert refused and all(r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1 for r in refused)


def test_auth_on_and_off(secured, served):
    assert _post(secured, {"model": "default", "messages": _chat("x"), "max_tokens": 1}).status_code == 401
    wrong = _post(secured, {"model": "default", "messages": _chat("x"), "max_tokens": 1}, {"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(secured.url + "/v1/models").status_code == 401
    ok = secured.client(KEY).chat.completions.create(model="default", messages=_chat("x"), max_tokens=1)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert [m.id for m in served.client().models.list().data] == ["default"]  # no key needed when none is set
    assert httpx.get(secured.url + "/health").status_code == 200  # health and metrics stay open


def test_every_route_but_health_and_metrics_needs_the_key(secured):
    """From the app's own route table, so a route added without the auth dependency fails here."""
    from starlette.routing import Route

    open_routes = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    checked = []
    for route in secured.app.routes:
        if not isinstance(route, Route) or route.path in open_routes:
            continue
        path = route.path.replace("{model_id:path}", "default")
        for method in sorted(route.methods or ()):
            if method in ("HEAD", "OPTIONS"):
                continue
            r = httpx.request(method, secured.url + path, json={"model": "default"}, timeout=30)
            assert r.status_code == 401, (method, route.path, r.status_code)
            checked.append(route.path)
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(checked)


def test_models_retrieve_a_served_id_and_404_another(served):
    client = served.client()
    assert client.models.retrieve("default").id == "default"
    alias = "majority_vote@n=4:default"
    assert client.models.retrieve(alias).id == alias
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_metrics_count_requests_and_tokens(served):
    before = httpx.get(served.url + "/metrics").text
    served.client().chat.completions.create(model="default", messages=_chat("Hi"), max_tokens=5, temperature=0)
    list(served.client().chat.completions.create(model="default", messages=_chat("Hi"), max_tokens=5, temperature=0,
                                                 stream=True))
    after = httpx.get(served.url + "/metrics").text

    def value(text, name):
        lines = [ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    assert value(after, "metaloom_completion_tokens_total") - value(before, "metaloom_completion_tokens_total") == 10
    ttft = "metaloom_time_to_first_token_seconds_count"
    assert value(after, ttft) > value(before, ttft)
    latency = 'metaloom_request_latency_seconds_count{route="/v1/chat/completions"}'
    assert value(after, latency) - value(before, latency) == 2  # once per request, streamed or not
    for name in ("metaloom_requests_total", "metaloom_queue_depth", "metaloom_running_rows", "metaloom_batch_size_bucket",
                 "metaloom_request_latency_seconds_bucket"):
        assert name in after
