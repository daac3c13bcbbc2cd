"""A fake OpenAI-compatible server (FastAPI), for tests of `RemoteGenerator`: vLLM's shapes, a
"model" whose answers, token ids and log-probabilities are known in closed form, features that
can be switched off, and scriptable faults.

The model: a token is a character, its id the code point (0 is end-of-sequence, text "").
The chat template writes each message as ``<|role|>content\\n`` and ends with ``<|assistant|>``.
Sample ``j`` of a request with seed ``s`` (0 without one) answers ``replies[prompt][(s + j) %
len]`` (default "ok"), then end-of-sequence; every token, generated or in the prompt, has
log-probability `logprob(id)`. A prompt seen before reports all but its last token as cached.

A switched-off feature is refused with a 400 naming the field by a ``strict`` server (as
OpenAI and metaloom serve do) and silently ignored by a lenient one (as vLLM does), so
detection's checks of what is honoured can be tested against both.

Faults (`Fault`, played by `metaloom.testing.fake_faults`) are taken in order by the requests
they match: a status (with Retry-After), a delay, a dropped connection (mid-body), a malformed
body, a stream cut after some events. ``log`` records every request (path, body) as it arrived,
faulted or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from metaloom.testing.fake_faults import GENERATION, Fault, Faults, error_response

VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "ignore_eos", "include_stop_str_in_output")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
           "stream", "stream_options", "user", "n", "seed", "logprobs"}
_ROUTE_FIELDS = {"/v1/completions": {"prompt", "echo"}, "/v1/chat/completions": {"messages", "top_logprobs",
                                                                                  "response_format"}}
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def logprob(token: int) -> float:
    """The fake model's log-probability of any token."""
    return -((token % 7) + 1) / 10


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids if i != 0)


def chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + ("<|assistant|>" if add_generation_prompt else "")


@dataclass(frozen=True)
class FakeFeatures:
    """What the fake serves. ``extras``: vLLM's sampling extras; ``token_ids``:
    ``return_tokens_as_token_ids``; ``continuous_usage``: usage in every stream chunk."""

    completions: bool = True
    chat: bool = True
    strict: bool = False
    n: bool = True
    logprobs: bool = True
    seed: bool = True
    extras: bool = True
    token_ids: bool = True
    prompt_logprobs: bool = True
    echo: bool = True
    token_prompts: bool = True
    guided: bool = True
    structured_outputs: bool = False  # vLLM >= 0.11's form
    response_format: bool = True
    continuous_usage: bool = True
    tokenize: bool = True

    @classmethod
    def minimal(cls) -> FakeFeatures:
        """An OpenAI-like server: strict, chat and completions with n, seed and log-probabilities only."""
        return cls(strict=True, extras=False, token_ids=False, prompt_logprobs=False, echo=False, token_prompts=False,
                   guided=False, continuous_usage=False, tokenize=False)


@dataclass
class _Sample:
    text: str
    ids: list[int]
    finish: str
    stop_reason: str | int | None


class FakeOpenAI:
    """The fake server's state; ``app`` is the ASGI app (serve it with
    `metaloom.testing.served.serve_app`)."""

    def __init__(self, model: str = "fake-model", features: FakeFeatures | None = None,
                 replies: Mapping[str, Sequence[str]] | None = None, stream_delay: float = 0.0,
                 latency: float = 0.0) -> None:
        self.model = model
        self.features = features or FakeFeatures()
        self.replies = {k: list(v) for k, v in (replies or {}).items()}
        self.stream_delay = stream_delay  # seconds before each stream event
        self.latency = latency  # seconds before each generation answer
        self.faults: list[Fault] = []
        self.log: list[tuple[str, Any]] = []
        self.active = 0  # requests being answered (a client that gave up may leave one running)
        self.in_flight = 0
        self.max_in_flight = 0
        self.streams_cancelled = 0
        self.seen_prompts: set[tuple[int, ...]] = set()
        self.app = self._build()

    def inject(self, *faults: Fault) -> None:
        self.faults.extend(faults)

    def count(self, path: str | None = None) -> int:
        """Requests received on ``path`` (default: the generation routes)."""
        return sum(1 for p, _ in self.log if (p == path if path is not None else p in GENERATION))

    def bodies(self, path: str | None = None) -> list[Any]:
        return [b for p, b in self.log if (p == path if path is not None else p in GENERATION)]

    # --- the model ---------------------------------------------------------------------------------
    def sample(self, prompt: str, body: Mapping[str, Any], j: int) -> _Sample:
        seed = body.get("seed") if self.features.seed else None
        k = (seed or 0) + j
        reply = self._reply(prompt, body, k)
        ids = [*encode(reply), 0]
        limit = body.get("max_tokens") or 16
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        include = bool(body.get("include_stop_str_in_output")) and self.features.extras
        text = ""
        for i, t in enumerate(ids[:limit]):
            if t == 0:
                return _Sample(text, ids[:i + 1], "stop", None)
            text += chr(t)
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                return _Sample(text if include else text[:text.index(hit)], ids[:i + 1], "stop", hit)
        return _Sample(text, ids[:limit], "length", None)

    def _reply(self, prompt: str, body: Mapping[str, Any], k: int) -> str:
        structured = body.get("structured_outputs") if self.features.structured_outputs else None
        structured = structured if isinstance(structured, dict) else {}
        if (self.features.guided and body.get("guided_choice")) or structured.get("choice"):
            choices = structured.get("choice") or body["guided_choice"]
            return str(choices[k % len(choices)])
        if structured.get("json") is not None or (self.features.guided and body.get("guided_json") is not None) or (
                self.features.response_format and isinstance(body.get("response_format"), dict)
                and body["response_format"].get("type") == "json_schema"):
            return '{"a": 1}'
        replies = self.replies.get(prompt) or ["ok"]
        return replies[k % len(replies)]

    # --- the app ------------------------------------------------------------------------------------
    def _build(self) -> Any:
        app = FastAPI()
        f = self.features

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}

        if f.completions:
            @app.post("/v1/completions")
            async def completions(request: HttpRequest) -> Response:
                return await self._generate(request, chat=False)

        if f.chat:
            @app.post("/v1/chat/completions")
            async def chat(request: HttpRequest) -> Response:
                return await self._generate(request, chat=True)

        if f.tokenize:
            @app.post("/tokenize")
            async def tokenize(request: HttpRequest) -> Response:
                body = await request.json()
                if "messages" in body:
                    ids = encode(chat_template(body["messages"], body.get("add_generation_prompt", True)))
                else:
                    ids = encode(body["prompt"])
                return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

            @app.post("/detokenize")
            async def detokenize(request: HttpRequest) -> Response:
                return JSONResponse({"prompt": decode((await request.json())["tokens"])})

        return Faults(app, self)

    async def _generate(self, request: HttpRequest, *, chat: bool) -> Response:
        body = await request.json()
        refused = self._refuse(body, "/v1/chat/completions" if chat else "/v1/completions")
        if refused is not None:
            return error_response(400, f"unknown field {refused!r}: not supported", param=refused)
        if body.get("model") != self.model:
            return error_response(404, f"The model `{body.get('model')}` does not exist.")
        if not isinstance(body.get("max_tokens", 16), int) or body.get("max_tokens", 16) < 1:
            return error_response(400, "max_tokens must be at least 1, got " + json.dumps(body.get("max_tokens")), "max_tokens")
        prompts = self._prompts(body, chat)
        if isinstance(prompts, str):
            return error_response(400, prompts, "prompt")
        if self.latency:  # requests waiting here at once: how many the client has in flight
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.latency)
            finally:
                self.in_flight -= 1
        if body.get("stream"):
            return StreamingResponse(self._events(body, prompts, chat), media_type="text/event-stream")
        return JSONResponse(self._answer(body, prompts, chat))

    def _refuse(self, body: Mapping[str, Any], path: str) -> str | None:
        """The switched-off or unknown field a strict server refuses (a lenient one ignores them)."""
        f = self.features
        off = {"n": not f.n, "seed": not f.seed, "logprobs": not f.logprobs, "echo": not f.echo,
               "return_tokens_as_token_ids": not f.token_ids, "prompt_logprobs": not f.prompt_logprobs,
               "response_format": not f.response_format, **dict.fromkeys(VLLM_EXTRAS, not f.extras),
               **dict.fromkeys(_GUIDED, not f.guided), "structured_outputs": not f.structured_outputs}
        known = _COMMON | _ROUTE_FIELDS[path] | set(off)
        for name, value in body.items():
            if value is None or value is False:
                continue
            if f.strict and (name not in known or off.get(name)):
                return name
        options = body.get("stream_options") or {}
        if f.strict and options.get("continuous_usage_stats") and not f.continuous_usage:
            return "stream_options.continuous_usage_stats"
        return None

    def _prompts(self, body: Mapping[str, Any], chat: bool) -> list[tuple[str, list[int]]] | str:
        """(text, ids) per prompt, or the message refusing the prompt."""
        if chat:
            text = chat_template(body.get("messages") or [])
            return [(text, encode(text))]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [(prompt, encode(prompt))]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [(p, encode(p)) for p in prompt]
        lists = [prompt] if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) else prompt
        if not self.features.token_prompts or not isinstance(lists, list) or not all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in lists):
            return "prompt must be a string or a list of strings"
        return [(decode(p), list(p)) for p in lists]

    def _answer(self, body: Mapping[str, Any], prompts: list[tuple[str, list[int]]], chat: bool) -> dict[str, Any]:
        n = body.get("n", 1) if self.features.n else 1
        choices, completion_tokens = [], 0
        for p, (text, ids) in enumerate(prompts):
            for j in range(n):
                s = self.sample(text, body, j)
                completion_tokens += len(s.ids)
                choices.append(self._choice(body, p * n + j, s, chat, (text, ids)))
        return {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "model": self.model,
                "choices": choices, "usage": self._usage(prompts, completion_tokens)}

    def _choice(self, body: Mapping[str, Any], index: int, s: _Sample, chat: bool,
                prompt: tuple[str, list[int]]) -> dict[str, Any]:
        f = self.features
        echo = not chat and f.echo and bool(body.get("echo"))
        text = (prompt[0] if echo else "") + s.text
        choice: dict[str, Any] = {"index": index, "finish_reason": s.finish, "stop_reason": s.stop_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        wants = body.get("logprobs") is not None and body.get("logprobs") is not False and f.logprobs
        choice["logprobs"] = self._logprobs(body, (prompt[1] if echo else []) + s.ids, chat, echoed=len(prompt[1]) if echo
                                            else 0) if wants else None
        if not chat and f.prompt_logprobs and body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [{str(t): {"logprob": logprob(t), "rank": 1, "decoded_token": chr(t)}}
                                                  for t in prompt[1][1:]]
        return choice

    def _logprobs(self, body: Mapping[str, Any], ids: Sequence[int], chat: bool, echoed: int = 0) -> dict[str, Any]:
        as_ids = self.features.token_ids and bool(body.get("return_tokens_as_token_ids"))
        tokens = [f"token_id:{t}" if as_ids else decode([t]) for t in ids]
        values: list[float | None] = [None if k == 0 and echoed else logprob(t) for k, t in enumerate(ids)]
        if chat:
            return {"content": [{"token": tok, "logprob": v, "bytes": list(tok.encode()), "top_logprobs": []}
                                for tok, v in zip(tokens, values, strict=True)]}
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
                "text_offset": [sum(len(decode([t])) for t in ids[:k]) for k in range(len(ids))]}

    def _usage(self, prompts: list[tuple[str, list[int]]], completion_tokens: int) -> dict[str, Any]:
        prompt_tokens = cached = 0
        for _, ids in prompts:
            prompt_tokens += len(ids)
            if tuple(ids) in self.seen_prompts:
                cached += len(ids) - 1
            self.seen_prompts.add(tuple(ids))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    async def _events(self, body: Mapping[str, Any], prompts: list[tuple[str, list[int]]], chat: bool) -> AsyncIterator[str]:
        """One token per event, the samples interleaved; then usage (in every event too, with
        ``continuous_usage_stats``: as vLLM, each chunk's usage counts its own choice's tokens)."""
        n = body.get("n", 1) if self.features.n else 1
        options = body.get("stream_options") or {}
        continuous = self.features.continuous_usage and bool(options.get("continuous_usage_stats"))
        text = prompts[0][0]
        samples = [self.sample(text, body, j) for j in range(n)]
        usage = self._usage(prompts[:1], 0)
        sent, finished = 0, False
        try:
            for step in range(max(len(s.ids) for s in samples)):
                for j, s in enumerate(samples):
                    if step >= len(s.ids):
                        continue
                    if self.stream_delay:
                        await asyncio.sleep(self.stream_delay)
                    sent += 1
                    event: dict[str, Any] = {"object": "chat.completion.chunk" if chat else "text_completion",
                                             "model": self.model, "choices": [self._piece(body, j, s, step, chat)]}
                    if continuous:  # as vLLM: that choice's own tokens so far, not the request's
                        mine = step + 1
                        event["usage"] = {**usage, "completion_tokens": mine, "total_tokens": usage["prompt_tokens"] + mine}
                    yield f"data: {json.dumps(event)}\n\n"
            if options.get("include_usage"):
                final = {**usage, "completion_tokens": sent, "total_tokens": usage["prompt_tokens"] + sent}
                yield f"data: {json.dumps({'object': 'chunk', 'model': self.model, 'choices': [], 'usage': final})}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.streams_cancelled += 1

    def _piece(self, body: Mapping[str, Any], j: int, s: _Sample, step: int, chat: bool) -> dict[str, Any]:
        # token k carries character k of the kept text (a cut stop string leaves later tokens empty)
        piece = s.text[step] if step < len(s.text) else ""
        last = step == len(s.ids) - 1
        choice: dict[str, Any] = {"index": j, "finish_reason": s.finish if last else None,
                                  "stop_reason": s.stop_reason if last else None}
        if chat:
            choice["delta"] = {"content": piece}
        else:
            choice["text"] = piece
        wants = body.get("logprobs") is not None and body.get("logprobs") is not False and self.features.logprobs
        choice["logprobs"] = self._logprobs(body, [s.ids[step]], chat) if wants else None
        return choice
