"""The OpenAI-compatible HTTP app (FastAPI): routes, errors in OpenAI's shape, auth, limits.

Plain requests go straight to the scheduler (continuous batching); a strategy (a ``metaloom``
object in the body, or a model alias ``majority_vote@n=8:default``) runs in a worker thread
against `ScheduledGenerator`, so its samples join the same decode loop. Usage is the request's
own ledger: prompt, completion and cached tokens, and a ``metaloom`` block with forward passes,
FLOPs, seconds and the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metaloom.decode.score import PromptPosition, shared_prompt_logprobs
from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.generator.local import LocalGenerator
from metaloom.generator.plan import check_ids, encode
from metaloom.generator.types import Completion, StreamChunk, TokenIds, TopLogprobs
from metaloom.generator.types import Request as GenerationRequest
from metaloom.ledger import Ledger, Usage
from metaloom.meta.types import Result
from metaloom.score.protocols import Raw
from metaloom.server import protocol, tools
from metaloom.server.errors import ApiError, api_error
from metaloom.server.memory import memory_parts, size_pools, storage_parts
from metaloom.server.metrics import Metrics
from metaloom.server.protocol import ChatBody, ChatFields, CompletionBody, CompletionFields
from metaloom.server.scheduled import Cancelled, ScheduledGenerator
from metaloom.server.scheduler import Event, Failed, Finished, Scheduler, Ticket
from metaloom.server.strategy import StrategyCall, resolve_model

log = logging.getLogger("metaloom.server")


class BodyLimit:
    """An ASGI middleware refusing bodies over ``limit`` bytes with 413, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = ApiError(413, f"request body over {self.limit} bytes", "invalid_request_error", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_big.response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await too_big.response()(scope, receive, send)


class _TooLarge(Exception):
    pass


def create_app(generator: LocalGenerator, *, model_ids: Sequence[str], api_key: str | None = None,
               max_rows: int = 64, max_waiting: int = 256, max_body_bytes: int = 4 << 20,
               strategy_workers: int = 8) -> FastAPI:
    """The server for ``generator``, answering to ``model_ids`` (the first is the listed id)."""
    metrics = Metrics()
    scheduler = Scheduler(generator, max_rows=max_rows, max_waiting=max_waiting,
                          on_step=lambda rows: metrics.batch_size.observe(rows))
    workers = ThreadPoolExecutor(max_workers=strategy_workers, thread_name_prefix="metaloom-strategy")
    ids = tuple(model_ids)
    size_pools(generator, max_rows)
    weights = storage_parts([generator.model, generator.amateur])

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()
        workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="metaloom", version="0.1.0", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    def admitting() -> None:
        """New work is refused once a shutdown began (work already in flight drains)."""
        if scheduler.draining:
            raise ApiError(503, "server shutting down: not accepting new requests", "server_error", code="shutting_down")

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_request_error",
                           code="invalid_api_key")

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(MetaloomError)
    async def _metaloom(_: Request, exc: MetaloomError) -> JSONResponse:
        return api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        if kind == "extra_forbidden":
            message = f"unknown field {param!r}: not an OpenAI or metaloom parameter"
        return ApiError(400, message, "invalid_request_error", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error",
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return api_error(exc).response()

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        started = time.perf_counter()
        response: Response = await call_next(request)
        route = request.url.path if request.url.path in _ROUTES else "other"
        metrics.requests.labels(route, str(response.status_code)).inc()
        if not response.headers.get("content-type", "").startswith("text/event-stream"):  # those: in _sse, at the end
            metrics.latency.labels(route).observe(time.perf_counter() - started)
        return response

    @app.get("/health", response_model=None)
    def health() -> Any:
        s = scheduler.stats()
        body = {"status": "draining" if scheduler.draining else "ok", "waiting": s.waiting, "running_rows": s.running_rows}
        return JSONResponse(body, status_code=503) if scheduler.draining else body

    @app.get("/metrics")
    def prometheus() -> Response:
        s = scheduler.stats()
        metrics.queue_depth.set(s.waiting)
        metrics.running.set(s.running_rows)
        for part, value in memory_parts(generator, weights).items():
            metrics.memory.labels(part).set(value)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "metaloom", "root": generator.loaded.name}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(ids[0])]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorised)])
    def model(model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve: a served id, or a strategy alias of one (STRATEGY@param=v,...:ID); 404 else."""
        resolve_model(model_id, ids, None)
        return model_card(model_id)

    @app.post("/tokenize", dependencies=[Depends(authorised)])
    def tokenize(body: protocol.TokenizeBody) -> dict[str, Any]:
        """Token ids as the server would read the prompt (vLLM's route and shapes)."""
        if body.model is not None:
            resolve_model(body.model, ids, None)  # 404 for a model not served
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameter("prompt", body.prompt, "exactly one of prompt and messages")
        protocol.valid_text(body.model_dump(exclude_none=True), "")
        tokenizer = generator.tokenizer
        if body.messages is not None:
            text = tokenizer.apply_chat_template(list(protocol.messages(body.messages)),
                                                 add_generation_prompt=body.add_generation_prompt)
            tokens = tokenizer.encode(text, add_special_tokens=False)
        else:
            tokens = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": generator.model.max_context, "tokens": tokens}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        return out

    @app.post("/detokenize", dependencies=[Depends(authorised)])
    def detokenize(body: protocol.DetokenizeBody) -> dict[str, Any]:
        if body.model is not None:
            resolve_model(body.model, ids, None)
        check_ids("tokens", body.tokens, generator.model.vocab_size)
        return {"prompt": generator.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised), Depends(admitting)], response_model=None)
    async def chat(body: ChatBody, request: Request) -> Response | dict[str, Any]:  # type: ignore[valid-type]
        b = cast(ChatFields, body)
        strategy = resolve_model(b.model, ids, b.metaloom)
        call = _Call(scheduler, metrics, workers, request, chat=True, model=b.model, logprobs=bool(b.logprobs),
                     token_ids=b.return_tokens_as_token_ids)
        call.continuous_usage = _continuous_usage(b)
        if strategy is not None:
            if protocol.calls_tools(body):
                raise InvalidParameter("tools", "set", "not set with a strategy (function calling is for plain requests)")
            return await call.strategy(strategy, protocol.chat_request(body)[0], b.stream, _usage_wanted(b))
        wanted, call.tools = protocol.chat_request(body, generator.tokenizer)
        return await call.plain(call.fit([wanted], b), b.stream, _usage_wanted(b), Ledger())

    @app.post("/v1/completions", dependencies=[Depends(authorised), Depends(admitting)], response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response | dict[str, Any]:  # type: ignore[valid-type]
        b = cast(CompletionFields, body)
        strategy = resolve_model(b.model, ids, b.metaloom)
        call = _Call(scheduler, metrics, workers, request, chat=False, model=b.model, logprobs=b.logprobs is not None,
                     token_ids=b.return_tokens_as_token_ids)
        call.continuous_usage = _continuous_usage(b)
        requests = protocol.completion_requests(body)
        k, only = protocol.prompt_logprobs(body), protocol.scores_only(body)
        if strategy is not None:
            if len(requests) != 1:
                raise ApiError(400, "a strategy takes one prompt", "invalid_request_error", param="prompt")
            if b.echo or k is not None:
                raise ApiError(400, "echo and prompt_logprobs are not served with a strategy", "invalid_request_error",
                               param="echo" if b.echo else "prompt_logprobs")
            return await call.strategy(strategy, requests[0], b.stream, _usage_wanted(b))
        ledger = Ledger()
        if b.echo or k is not None:
            call.prompts = await call.read_prompts(requests, k, ledger, count_input=only)
            call.echo = bool(b.echo)
        if only:
            return call.prompts_only(len(requests) * requests[0].params.n, b.stream, _usage_wanted(b), ledger)
        return await call.plain(call.fit(requests, b), b.stream, _usage_wanted(b), ledger)

    return app


_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                     "/detokenize"})


def _continuous_usage(body: ChatFields | CompletionFields) -> bool:
    return bool(body.stream_options is not None and body.stream_options.continuous_usage_stats)


def _usage_wanted(body: ChatFields | CompletionFields) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


class _Call:
    """One HTTP call's run: submit, wait or stream, build the OpenAI response."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, workers: ThreadPoolExecutor, http: Request, *,
                 chat: bool, model: str, logprobs: bool, token_ids: bool = False) -> None:
        self.scheduler, self.metrics, self.workers, self.http = scheduler, metrics, workers, http
        self.chat, self.model, self.logprobs, self.token_ids = chat, model, logprobs, token_ids
        self.prompts: list[_Prompted] | None = None  # per request, when echo or prompt_logprobs asked for them
        self.echo = False
        self.continuous_usage = False  # stream_options.continuous_usage_stats
        self.tools = False  # replies are read for function calls (`metaloom.server.tools`)
        self.streams: dict[int, tools.ToolStream] = {}  # with tools: each streamed choice's reader
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.tokenizer = scheduler.generator.tokenizer
        self.object = "chat.completion" if chat else "text_completion"

    # --- plain requests ----------------------------------------------------------------------
    def fit(self, requests: list[GenerationRequest], body: ChatFields | CompletionFields) -> list[GenerationRequest]:
        """Without ``max_tokens``, a request may fill the context window (as OpenAI and vLLM do)."""
        if body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None:
            return requests
        engine = self.scheduler.generator
        out = []
        for r in requests:
            used = len(r.prompt.ids) if isinstance(r.prompt, TokenIds) else len(encode(engine, r.prompt))
            room = engine.model.max_context - used
            out.append(dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=room)) if room > 0 else r)
        return out

    async def read_prompts(self, requests: list[GenerationRequest], k: int | None, ledger: Ledger, *,
                           count_input: bool) -> list[_Prompted]:
        """Each request's prompt as text and ids; with ``k``, their log-probabilities too (one pass
        over them all, what they share computed once, on the loop thread between two steps)."""
        engine = self.scheduler.generator
        ids = [list(r.prompt.ids) if isinstance(r.prompt, TokenIds) else encode(engine, r.prompt) for r in requests]
        positions: list[list[PromptPosition] | None] = [None] * len(requests)
        if k is None and count_input:
            ledger.charge(input_tokens=sum(map(len, ids)))
        elif k is not None:  # one pass for all: what the prompts share is computed once (decode.score)
            for one in ids:
                check_ids("prompt ids", one, engine.model.vocab_size)
            def read(k: int = k) -> list[list[PromptPosition]]:
                started = time.perf_counter()
                try:
                    return shared_prompt_logprobs(engine.model, ids, k, ledger, pool=engine.pool, count_input=count_input)
                finally:
                    ledger.charge(seconds=time.perf_counter() - started)
            positions = list(await asyncio.wrap_future(self.scheduler.call(read)))
        return [_Prompted(r.prompt if isinstance(r.prompt, str) else self.tokenizer.decode(i), i, p)
                for r, i, p in zip(requests, ids, positions, strict=True)]

    def prompts_only(self, choices: int, stream: bool, include_usage: bool,
                     ledger: Ledger) -> StreamingResponse | dict[str, Any]:
        """``echo`` with ``max_tokens: 0``: each prompt back (with its log-probabilities), nothing generated."""
        assert self.prompts is not None
        n = choices // len(self.prompts)
        empty = Completion(text="", token_ids=(), logprobs=(), finish_reason="length")
        self._observe(ledger.usage, [])
        if stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                for i in range(choices):
                    out = self._chunk(i, {"text": ""}, "length")
                    self._decorate(out["choices"][0], i // n, empty)
                    yield out
                if include_usage:
                    yield self._usage_chunk(ledger.usage)
            return self._sse(events())
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(i, empty, i // n) for i in range(choices)], "usage": usage_block(ledger.usage)}

    async def plain(self, requests: list[GenerationRequest], stream: bool, include_usage: bool,
                    ledger: Ledger) -> StreamingResponse | dict[str, Any]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        tickets: list[Ticket] = []
        try:
            for i, r in enumerate(requests):  # all validated (a bad one raises: 400) before any compute
                def sink(event: Event, i: int = i) -> None:
                    loop.call_soon_threadsafe(inbox.put_nowait, (i, event))
                tickets.append(self.scheduler.submit(r, ledger, sink))
        except BaseException:
            for t in tickets:
                t.cancel()
            raise
        n = requests[0].params.n
        if stream:
            return self._sse(self._stream_plain(inbox, tickets, ledger, n, include_usage))
        try:
            results: dict[int, tuple[Completion, ...]] = {}
            while len(results) < len(requests):
                i, event = await self._next(inbox)
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    results[i] = event.completions
        finally:
            for t in tickets:
                t.cancel()  # a no-op for finished ones; frees the rows of a client gone away
            self._observe(ledger.usage, tickets)  # what was generated, for a client gone away too
        choices = [self._choice(i * n + j, c, i) for i in range(len(requests)) for j, c in enumerate(results[i])]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_block(ledger.usage)}

    async def _next(self, inbox: asyncio.Queue[tuple[int, Event]]) -> tuple[int, Event]:
        """The next event; a client that went away cancels the request (checked twice a second)."""
        while True:
            try:
                return await asyncio.wait_for(inbox.get(), timeout=0.5)
            except TimeoutError:
                if await self.http.is_disconnected():
                    raise Cancelled("client disconnected") from None

    async def _stream_plain(self, inbox: asyncio.Queue[tuple[int, Event]], tickets: list[Ticket], ledger: Ledger, n: int,
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        observed = False
        try:
            if self.chat:
                for j in range(n):
                    yield self._chunk(j, {"role": "assistant", "content": ""})
            elif self.prompts is not None:  # echo / prompt_logprobs: the prompt first, once per choice
                empty = Completion(text="", token_ids=(), logprobs=(), finish_reason="length")
                for i in range(len(tickets) * n):
                    out = self._chunk(i, {"text": ""})
                    self._decorate(out["choices"][0], i // n, empty)
                    yield out
            finished = 0
            sent: dict[int, int] = {}
            while finished < len(tickets):
                i, event = await inbox.get()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    finished += 1
                    continue
                assert isinstance(event, StreamChunk)
                index = i * n + event.index
                outs = self._tool_deltas(index, event) if self.tools else [self._delta(index, event)]
                if self.continuous_usage:  # vLLM's meaning: this choice's tokens so far, beside the request's prompt
                    sent[index] = sent.get(index, 0) + len(event.token_ids)
                    prompt = ledger.usage.input_tokens
                    outs[-1]["usage"] = {"prompt_tokens": prompt, "completion_tokens": sent[index],
                                         "total_tokens": prompt + sent[index]}
                for out in outs:
                    yield out
            observed = True
            self._observe(ledger.usage, tickets)
            if include_usage:
                yield self._usage_chunk(ledger.usage)
        finally:
            for t in tickets:
                t.cancel()
            if not observed:  # a stream the client closed: its tokens were generated all the same
                self._observe(ledger.usage, tickets)

    # --- strategies -----------------------------------------------------------------------------
    async def strategy(self, call: StrategyCall, request: GenerationRequest, stream: bool,
                       include_usage: bool) -> StreamingResponse | dict[str, Any]:
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        prompt, sampling = request.prompt, request.params
        if isinstance(prompt, TokenIds):  # strategies and their scorers read the question as text
            raise ApiError(400, "a strategy takes a text prompt or chat messages, not token ids", "invalid_request_error",
                           param="prompt")
        if isinstance(prompt, str):  # /v1/completions: the text as it is (a strategy reads a plain str as chat)
            prompt = Raw(prompt)
        if sampling.n != 1:  # the rest was checked with the call (names, types, values); this needs the body
            raise InvalidParameter("n", sampling.n, "1 with a strategy (its samples are its own parameter, e.g. n)")
        tally: dict[str, Any] = {"calls": 0, "samples_finished": 0, "output_tokens": 0}

        def on_done(completions: tuple[Completion, ...]) -> None:  # a generator call finished
            tally["calls"] += 1
            tally["samples_finished"] += len(completions)
            tally["output_tokens"] += sum(len(c.token_ids) for c in completions)
            loop.call_soon_threadsafe(progress.put_nowait, dict(tally))

        def on_event(kind: str, data: dict[str, Any]) -> None:  # a step of the strategy's trace: votes so far, ...
            loop.call_soon_threadsafe(progress.put_nowait, {**tally, "trace": _jsonable({"kind": kind, **data})})

        gen = ScheduledGenerator(self.scheduler, on_done=on_done)
        ledger = Ledger(budget=call.budget, listener=on_event if stream else None)
        # built in the worker: a component may load a model (a reward model), which must not block the event loop
        future = loop.run_in_executor(self.workers, lambda: call.build(sampling, gen).run(prompt, gen, ledger=ledger))
        if stream:
            return self._sse(self._stream_strategy(call, future, progress, gen, ledger, include_usage))
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=0.5)
                if done:
                    break
                if await self.http.is_disconnected():
                    raise Cancelled("client disconnected")
        finally:
            if not future.done():
                gen.cancel()
        result = future.result()
        self._observe(result.usage, [])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._strategy_choice(result)], "usage": usage_block(result.usage),
                "metaloom": call.report(result)}

    async def _stream_strategy(self, call: StrategyCall, future: asyncio.Future[Result],
                               progress: asyncio.Queue[dict[str, Any]],
                               gen: ScheduledGenerator, ledger: Ledger, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.chat:
                yield self._chunk(0, {"role": "assistant", "content": ""})
            while not future.done():
                getter = asyncio.ensure_future(progress.get())
                waiting: set[asyncio.Future[Any]] = {future, getter}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield self._progress(call, getter.result())
                else:
                    getter.cancel()
            while not progress.empty():
                yield self._progress(call, progress.get_nowait())
            result = future.result()
            self._observe(result.usage, [])
            text = {"content": result.best} if self.chat else {"text": result.best}
            yield self._chunk(0, text)
            yield self._chunk(0, {} if self.chat else {"text": ""}, finish=_finish(result))
            if include_usage:
                yield {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_block(result.usage), "metaloom": call.report(result)}
        finally:
            if not future.done():
                gen.cancel()

    def _progress(self, call: StrategyCall, tally: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [], "metaloom": {"event": "progress", "strategy": call.name, **tally}}

    # --- response pieces --------------------------------------------------------------------------
    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta.get("text", "")
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_block(usage)}

    def _delta(self, index: int, chunk: StreamChunk) -> dict[str, Any]:
        delta = ({"content": chunk.text} if chunk.text else {}) if self.chat else {"text": chunk.text}
        out = self._chunk(index, delta, chunk.finish_reason)
        choice = out["choices"][0]
        if self.logprobs and chunk.token_ids:
            choice["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs or None)
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.stop_reason
            if chunk.error is not None:
                choice["error"] = chunk.error
        return out

    def _tool_deltas(self, index: int, chunk: StreamChunk) -> list[dict[str, Any]]:
        """A streamed chunk of a choice whose reply may call functions: OpenAI's deltas (content,
        each call's id and name, its arguments in pieces), the chunk's log-probabilities on the
        first, the finish reason (``tool_calls`` for a reply that called) on the last."""
        stream = self.streams.setdefault(index, tools.ToolStream())
        deltas = stream.feed(chunk.text)
        if chunk.finish_reason is not None:
            deltas += stream.finish()
        outs = [self._chunk(index, d) for d in deltas] or [self._chunk(index, {})]
        if self.logprobs and chunk.token_ids:
            outs[0]["choices"][0]["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs or None)
        if chunk.finish_reason is not None:
            last = outs[-1]["choices"][0]
            last["finish_reason"] = "tool_calls" if stream.calls and chunk.finish_reason == "stop" else chunk.finish_reason
            last["stop_reason"] = chunk.stop_reason
            if chunk.error is not None:
                last["error"] = chunk.error
        return outs

    def _choice(self, index: int, c: Completion, request: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason,
                                  "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs) if self.logprobs else None}
        if self.chat and self.tools:
            choice["message"], called = tools.message(c.text)
            if called and c.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
            if self.prompts is not None:
                self._decorate(choice, request, c)
        if c.error is not None:
            choice["error"] = c.error
        return choice

    def _decorate(self, choice: dict[str, Any], request: int, c: Completion) -> None:
        """A completions choice with its prompt: echoed before the text (and its log-probabilities
        before the text's), and vLLM's ``prompt_logprobs``."""
        assert self.prompts is not None
        p = self.prompts[request]
        if p.positions is not None:
            choice["prompt_logprobs"] = [None, *({str(t): {"logprob": _finite(lp), "rank": rank, "decoded_token": self._name(t)}
                                                  for t, lp, rank in self._ranked(pos)} for pos in p.positions)]
        if not self.echo:
            return
        choice["text"] = p.text + choice["text"]
        if self.logprobs and p.positions is not None:
            head = self._logprobs(p.ids[1:], [q.logprob for q in p.positions], [q.top for q in p.positions])
            first = self._name(p.ids[0])
            tail = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            shift = len(first) + sum(len(t) for t in head["tokens"])
            choice["logprobs"] = {
                "tokens": [first, *head["tokens"], *tail["tokens"]],
                "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
                "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
                "text_offset": [0, *(len(first) + o for o in head["text_offset"]), *(shift + o for o in tail["text_offset"])],
            }

    @staticmethod
    def _ranked(pos: Any) -> list[tuple[int, float, int]]:
        """vLLM's prompt_logprobs entry: the prompt token with its rank, then the k most likely."""
        out = [(pos.token, pos.logprob, pos.rank)]
        out += [(t, lp, r) for r, (t, lp) in enumerate(pos.top, start=1) if t != pos.token]
        return out

    def _strategy_choice(self, result: Result) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(result), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.best}
        else:
            choice["text"] = result.best
        return choice

    def _name(self, token: int) -> str:
        """A token as logprobs name it: its text, or vLLM's exact ``token_id:N``."""
        return f"token_id:{token}" if self.token_ids else self.tokenizer.decode([token])

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[TopLogprobs] | None) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's ``content`` list, or the completions API's parallel lists.
        ``tops``: each position's most likely tokens (None: not asked for)."""
        tokens = [self._name(t) for t in ids]
        values = [_finite(lp) for lp in lps]
        alternatives = [[(self._name(t), _finite(lp)) for t, lp in top] for top in tops] if tops else None
        if self.chat:
            def entry(t: str, lp: float) -> dict[str, Any]:
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(*a) for a in alternatives[i]] if alternatives else []}
                                for i, (t, lp) in enumerate(zip(tokens, values, strict=True))]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top_maps = [dict(a) for a in alternatives] if alternatives else [{} for _ in tokens]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps, "text_offset": offsets}

    def _sse(self, events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:
                error = api_error(exc)
                if error.status >= 500 and error.status != 503:  # 503: a shutdown, not a fault
                    log.error("error while streaming", exc_info=exc)
                yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.latency.labels("/v1/chat/completions" if self.chat else "/v1/completions").observe(
                time.perf_counter() - self.started)
        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _observe(self, usage: Usage, tickets: Sequence[Ticket]) -> None:
        self.metrics.prompt_tokens.inc(usage.input_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.completion_tokens.inc(usage.output_tokens)
        for t in tickets:
            if t.first_token_at is not None:
                self.metrics.ttft.observe(t.first_token_at - t.submitted)


@dataclasses.dataclass(frozen=True)
class _Prompted:
    """A completions prompt as echo and prompt_logprobs report it; ``positions``: its tokens'
    log-probabilities from the second on (None: not asked for)."""

    text: str
    ids: list[int]
    positions: list[PromptPosition] | None


def _jsonable(value: Any) -> Any:
    """A trace event's data as strict JSON takes it: non-finite numbers become null."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, (str, int, bool)) else str(value)


def _finite(lp: float) -> float:
    return lp if lp == lp and lp != float("-inf") else -9999.0  # strict JSON has no NaN/-inf


def _finish(result: Result) -> str:
    if result.stopped_reason is not None:  # "budget"
        return str(result.stopped_reason)
    if result.best_index is not None and result.candidates:
        return result.candidates[result.best_index].finish_reason
    return "stop"


def usage_block(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage, with the ledger's other figures under ``metaloom``."""
    extra = {k: v for k, v in usage.to_dict().items()
             if k not in ("input_tokens", "output_tokens", "cached_tokens")}
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}, "metaloom": extra}
