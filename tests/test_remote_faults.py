"""`RemoteGenerator` against the fake OpenAI server's scripted faults: retries where they belong
(429 with Retry-After, 5xx, a dropped connection, a malformed body) and never on another 4xx or
a timeout; every answer charged exactly once; `Unsupported` before anything is sent; bounded
concurrency; emulated ``n``; cancellation (closed streams, `cancel`) and budgets."""

from __future__ import annotations

import threading
import time

import pytest

from metaloom.decode.specs import BeamParams, ContrastiveParams
from metaloom.errors import InvalidParameter, RemoteError, RemoteTimeout, Unsupported
from metaloom.generator.remote import RemoteGenerator, RetryPolicy
from metaloom.generator.remote.transport import retry_after
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import Budget, Ledger, Usage
from metaloom.meta import FirstFinish
from metaloom.sampling.params import SamplingParams
from metaloom.score.protocols import Raw
from metaloom.testing.fake_faults import Fault
from metaloom.testing.fake_openai import FakeFeatures, FakeOpenAI
from metaloom.testing.served import serve_app

FAST = RetryPolicy(max_retries=3, base_delay=0.01, max_delay=0.05)
REPLIES = {"hi": ["hello", "bye"], "q": ["a long long answer", "short", "a medium one"]}
HI = Usage(input_tokens=2, output_tokens=6)  # "hi" -> "hello" + end-of-sequence


def tokens_of(ledger: Ledger) -> Usage:
    """The ledger without its wall time."""
    u = ledger.usage
    return Usage(input_tokens=u.input_tokens, cached_tokens=u.cached_tokens, output_tokens=u.output_tokens,
                 forward_passes=u.forward_passes, flops=u.flops)


@pytest.fixture(scope="module")
def served():
    fake = FakeOpenAI(replies=REPLIES)
    with serve_app(fake.app) as url:
        yield fake, url


@pytest.fixture(scope="module")
def base(served):
    _, url = served
    with RemoteGenerator(url, "fake-model", retry=FAST) as g:
        yield g


@pytest.fixture
def fake(served):
    """The shared fake, fresh: no faults, an empty log, nothing cached, no latency — and no
    request of an earlier test still running (a timed-out one goes on on the server)."""
    server, _ = served
    deadline = time.monotonic() + 10
    while server.active and time.monotonic() < deadline:
        time.sleep(0.01)
    server.faults.clear()
    server.log.clear()
    server.seen_prompts.clear()
    server.latency = server.stream_delay = 0.0
    server.max_in_flight = server.streams_cancelled = 0
    return server


def remote(served, base, **kw) -> RemoteGenerator:
    """Another client of the shared fake, with the features already detected (no probes)."""
    return RemoteGenerator(served[1], "fake-model", features=base.features, **{"retry": FAST, **kw})


def hi(g: RemoteGenerator, ledger: Ledger | None = None, **params):
    return g.generate([Request("hi", SamplingParams(temperature=0, **params))], ledger=ledger or Ledger())[0]


# --- the retry policy --------------------------------------------------------------------------

def test_backoff_doubles_with_jitter_and_honours_retry_after():
    p = RetryPolicy(max_retries=4, base_delay=0.5, max_delay=3.0, jitter=0.25, max_retry_after=60)
    assert [p.delay(k, None, 0.0) for k in range(4)] == [0.5, 1.0, 2.0, 3.0]  # capped at max_delay
    assert [p.delay(k, None, 1.0) for k in range(3)] == [0.375, 0.75, 1.5]  # jitter shortens by up to 25%
    assert p.delay(4, None, 0.0) is None  # retries spent
    assert p.delay(0, 7.0, 0.5) == 7.0  # Retry-After replaces the backoff, unjittered
    assert p.delay(0, 61.0, 0.5) is None  # longer than max_retry_after: give up at once
    assert retry_after({"retry-after": "2"}) == 2.0
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) < 0  # a date in the past
    assert retry_after({}) is None
    with pytest.raises(InvalidParameter, match="max_retries"):
        RetryPolicy(max_retries=-1)


# --- what is retried, and charged once -------------------------------------------------------------

def test_429_waits_for_retry_after_then_succeeds_and_is_charged_once(fake, base):
    fake.inject(Fault("status", 429, "slow down", retry_after="0.3"), Fault("status", 429, "slow down", retry_after="0.3"))
    ledger = Ledger()
    started = time.perf_counter()
    out = hi(base, ledger)
    assert time.perf_counter() - started >= 0.6
    assert out[0].text == "hello" and fake.count() == 3
    assert tokens_of(ledger) == HI


@pytest.mark.parametrize("faults", [
    [Fault("status", 500)],
    [Fault("status", 503), Fault("status", 502)],
    [Fault("drop")],
    [Fault("malformed")],
    [Fault("drop"), Fault("malformed"), Fault("status", 500)],
], ids=["500", "503-502", "dropped", "malformed", "all"])
def test_5xx_dropped_connections_and_malformed_bodies_are_retried(fake, base, faults):
    fake.inject(*faults)
    ledger = Ledger()
    assert hi(base, ledger)[0].text == "hello"
    assert fake.count() == len(faults) + 1
    assert tokens_of(ledger) == HI  # the failed attempts charged nothing


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 422])
def test_other_4xx_are_never_retried_and_carry_the_servers_message(fake, base, status):
    fake.inject(Fault("status", status, f"refused with {status}: max_tokens is too large"))
    ledger = Ledger()
    with pytest.raises(RemoteError) as info:
        hi(base, ledger)
    assert info.value.status == status and info.value.attempts == 1
    assert info.value.message == f"refused with {status}: max_tokens is too large"
    assert f"refused with {status}" in str(info.value)
    assert fake.count() == 1
    assert tokens_of(ledger) == Usage()


def test_exhausted_retries_raise_the_last_error_with_the_attempts(fake, served, base):
    fake.inject(*[Fault("status", 500, "still broken")] * 3)
    g = remote(served, base, retry=RetryPolicy(max_retries=2, base_delay=0.01))
    ledger = Ledger()
    with pytest.raises(RemoteError, match=r"answered 500 \(after 3 attempts\): still broken") as info:
        hi(g, ledger)
    assert (info.value.status, info.value.attempts, fake.count()) == (500, 3, 3)
    assert tokens_of(ledger) == Usage()
    g.close()


def test_a_retry_after_beyond_the_limit_is_not_waited_for(fake, base):
    fake.inject(Fault("status", 429, "come back tomorrow", retry_after="86400"))
    started = time.perf_counter()
    with pytest.raises(RemoteError, match="come back tomorrow"):
        hi(base)
    assert time.perf_counter() - started < 2 and fake.count() == 1


def test_a_timeout_is_typed_and_not_retried(fake, served, base):
    fake.inject(Fault("delay", seconds=1.5))
    g = remote(served, base, timeout=0.3)
    started = time.perf_counter()
    with pytest.raises(RemoteTimeout):
        hi(g)
    assert time.perf_counter() - started < 1.2 and fake.count() == 1
    g.close()


def test_a_stream_is_retried_before_its_first_event_but_not_after(fake, base):
    fake.inject(Fault("status", 503))
    chunks = list(base.stream(Request("hi", SamplingParams(temperature=0)), ledger=Ledger()))
    assert "".join(c.text for c in chunks) == "hello" and fake.count() == 2
    fake.log.clear()
    fake.inject(Fault("cut", events=2))
    seen = []
    with pytest.raises(RemoteError, match="broke off"):
        for chunk in base.stream(Request("hi", SamplingParams(temperature=0)), ledger=Ledger()):
            seen.append(chunk.text)
    assert seen == ["h", "e"] and fake.count() == 1  # what was yielded cannot be taken back


# --- refused before anything is sent ----------------------------------------------------------------

@pytest.fixture(scope="module")
def minimal():
    """An OpenAI-like server: strict, no vLLM extras, no tokenizer routes, no token-id prompts."""
    server = FakeOpenAI(features=FakeFeatures.minimal(), replies=REPLIES)
    with serve_app(server.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        yield server, g


@pytest.mark.parametrize("request_", [
    Request("hi", decoder=BeamParams(beams=2)),
    Request("hi", decoder=ContrastiveParams()),
    Request("hi", token_healing=True),
    Request(TokenIds((104, 105))),
    Request("hi", prefix=(104,)),
    Request("hi", SamplingParams(top_k=5)),
    Request("hi", SamplingParams(typical_p=0.9)),
    Request("hi", SamplingParams(top_logprobs=2)),
], ids=["beam", "contrastive", "healing", "token-ids", "prefix", "top_k", "typical_p", "top_logprobs"])
def test_unsupported_requests_are_refused_before_anything_is_sent(minimal, request_):
    fake, g = minimal
    before = len(fake.log)
    with pytest.raises(Unsupported):
        g.generate([Request("hi"), request_], ledger=Ledger())  # the good one is not sent either
    with pytest.raises(Unsupported):
        g.stream(request_, ledger=Ledger())
    assert len(fake.log) == before


def test_score_render_and_constraints_are_refused_where_the_server_lacks_them(minimal):
    from metaloom.constrain.spec import ConstraintSpec

    fake, g = minimal
    before = len(fake.log)
    with pytest.raises(Unsupported, match="score"):
        g.score("hi", ["x"], ledger=Ledger())
    with pytest.raises(Unsupported, match="render"):
        g.render([{"role": "user", "content": "hi"}])
    with pytest.raises(Unsupported, match="constraint regex"):
        g.generate([Request("hi", constraint=ConstraintSpec.regex("a+"))], ledger=Ledger())
    with pytest.raises(Unsupported, match="text prompt"):  # JSON only through chat's response_format
        g.generate([Request("hi", constraint=ConstraintSpec.json_schema({"type": "object"}))], ledger=Ledger())
    assert len(fake.log) == before
    chat = Request.chat("hi", SamplingParams(max_tokens=12))
    out = g.generate([Request(chat.prompt, chat.params, constraint=ConstraintSpec.json_schema({"type": "object"}))],
                     ledger=Ledger())
    assert out[0][0].text == '{"a": 1}' and fake.bodies()[-1]["response_format"]["type"] == "json_schema"


def test_detection_retries_and_takes_a_broken_optional_route_as_absent():
    fake = FakeOpenAI()
    fake.inject(Fault("status", 503, path="/v1/models"), *[Fault("status", 500, path="/tokenize")] * 4)
    with serve_app(fake.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        assert [p for p, _ in fake.log].count("/v1/models") == 2  # retried
        assert not g.features.tokenize and g.features.n and g.features.guided  # the rest was found
        assert not fake.faults


def test_an_unlisted_model_is_a_typed_error_naming_it(served):
    fake, url = served
    fake.log.clear()
    with pytest.raises(InvalidParameter, match=r"no-such-model.*fake-model"):
        RemoteGenerator(url, "no-such-model")
    assert [p for p, _ in fake.log] == ["/v1/models"]


# --- concurrency, emulated n, usage ------------------------------------------------------------------

def test_concurrency_is_bounded(fake, served, base):
    fake.latency = 0.2
    g = remote(served, base, max_concurrency=2)
    started = time.perf_counter()
    out = g.generate([Request("hi", SamplingParams(temperature=0)) for _ in range(6)], ledger=Ledger())
    assert [c[0].text for c in out] == ["hello"] * 6
    assert fake.max_in_flight == 2 and time.perf_counter() - started >= 0.6
    g.close()


def test_a_server_that_ignores_n_gets_concurrent_requests_with_distinct_seeds(fake, base):
    no_n = FakeOpenAI(features=FakeFeatures(n=False), replies=REPLIES)  # lenient: n is silently ignored
    with serve_app(no_n.app) as url, RemoteGenerator(url, "fake-model", retry=FAST) as g:
        assert not g.features.n and "n" in g.capabilities.sampling
        no_n.log.clear()
        request = Request("q", SamplingParams(n=3, seed=5, max_tokens=64))
        ledger = Ledger()
        emulated = g.generate([request], ledger=ledger)[0]
        assert sorted(b["seed"] for b in no_n.bodies()) == [5, 6, 7] and all("n" not in b for b in no_n.bodies())
    reference = base.generate([request], ledger=Ledger())[0]  # the same samples as a server's own n
    assert [c.text for c in emulated] == [c.text for c in reference] == ["a medium one", "a long long answer", "short"]
    assert ledger.usage.input_tokens == 3  # three requests, each reporting its (one-token) prompt
    assert ledger.usage.output_tokens == sum(len(c.token_ids) for c in emulated)


def test_usage_carries_cached_tokens_and_flops_are_an_estimate(fake, served, base):
    g = remote(served, base, model_params=1000)
    ledger = Ledger()
    hi(g, ledger)
    hi(g, ledger)  # the fake has seen this prompt: all but its last token cached
    assert tokens_of(ledger) == Usage(input_tokens=4, cached_tokens=1, output_tokens=12, flops=2 * 1000 * (4 - 1 + 12))
    assert g.accounting["forward_passes"] == "unknown" and g.accounting["flops"].startswith("estimate")
    assert base.accounting["flops"] == "unknown"
    g.close()


# --- budgets and cancellation -----------------------------------------------------------------------

def test_a_budget_passed_mid_call_stops_what_is_still_out(fake, served, base):
    fake.latency = 0.15
    g = remote(served, base, max_concurrency=1)
    ledger = Ledger(budget=Budget(output_tokens=5))
    out = g.generate([Request("hi", SamplingParams(temperature=0)) for _ in range(3)], ledger=ledger)
    assert out[0][0].text == "hello" and [c[0].finish_reason for c in out] == ["stop", "budget", "budget"]
    assert ledger.over_budget()
    sent = fake.count()
    assert sent <= 2  # the third never went out
    again = g.generate([Request("hi")], ledger=ledger)  # nothing more is spent once the budget is gone
    assert again[0][0].finish_reason == "budget" and fake.count() == sent
    chunks = list(g.stream(Request("hi", SamplingParams(n=2)), ledger=ledger))
    assert [(c.index, c.finish_reason) for c in chunks] == [(0, "budget"), (1, "budget")] and fake.count() == sent
    g.close()


def test_closing_a_stream_early_cancels_it_on_the_server_and_charges_what_came(fake, base):
    fake.stream_delay = 0.05
    ledger = Ledger()
    stream = base.stream(Request("q", SamplingParams(max_tokens=64)), ledger=ledger)
    first = [next(stream), next(stream)]
    stream.close()
    deadline = time.monotonic() + 5
    while fake.streams_cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [c.text for c in first] == ["a", " "] and fake.streams_cancelled == 1
    # continuous usage: what the server had reported when the stream closed (the prompt, some tokens)
    assert ledger.usage.input_tokens == 1 and 2 <= ledger.usage.output_tokens < len("a long long answer")


def test_first_finish_streams_and_cancels_the_losers(fake, base):
    fake.stream_delay = 0.01
    ledger = Ledger()
    result = FirstFinish(n=3, mode="stream", max_tokens=64, params=SamplingParams(temperature=0.7)).run(
        Raw("q"), base, ledger=ledger)  # the fake's replies are keyed by the text it is sent (a str is a chat)
    assert result.best == "short" and result.best_index == 1
    assert [c.finish_reason for c in result.candidates] == ["cancelled", "stop", "cancelled"]
    deadline = time.monotonic() + 5
    while fake.streams_cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.streams_cancelled == 1 and fake.count() == 1
    assert ledger.usage.output_tokens >= len("short") + 1


def test_cancel_ends_the_requests_in_flight(fake, base):
    fake.latency = 2.0
    out: list = []
    worker = threading.Thread(target=lambda: out.append(base.generate(
        [Request("hi"), Request("hi", SamplingParams(n=2))], ledger=Ledger())))
    started = time.perf_counter()
    worker.start()
    deadline = time.monotonic() + 5
    while fake.count() < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert base.cancel() == 2
    worker.join(timeout=5)
    assert time.perf_counter() - started < 1.5
    assert [[c.finish_reason for c in row] for row in out[0]] == [["cancelled"], ["cancelled", "cancelled"]]
    fake.latency = 0.0
    assert hi(base)[0].text == "hello"  # later calls run as usual


def test_a_server_without_exact_counts_marks_forward_passes_unknown_and_flops_estimated():
    from metaloom.generator.remote.wire import usage_charge

    usage = {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}
    estimated = usage_charge(usage, 1e6)
    # the KV memory a request held is the server's alone to know: unknown unless metaloom reports it
    assert estimated["flops"] == 2e6 * (10 - 4 + 5) and estimated["unknown"] == {"forward_passes", "kv_bytes_peak"}
    assert estimated["estimated"] == {"flops"}
    assert usage_charge(usage, None)["unknown"] == {"forward_passes", "flops", "kv_bytes_peak"}
    exact = usage_charge({**usage, "metaloom": {"forward_passes": 3, "flops": 7.0, "kv_bytes_peak": 4096}}, 1e6)
    assert "unknown" not in exact and "estimated" not in exact and exact["forward_passes"] == 3
    assert exact["kv_bytes_peak"] == 4096
    older = usage_charge({**usage, "metaloom": {"forward_passes": 3, "flops": 7.0}}, 1e6)  # a server before the figure
    assert older["unknown"] == {"kv_bytes_peak"} and older["forward_passes"] == 3
