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
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.generator.local import LocalGenerator
from metaloom.generator.plan import encode
from metaloom.generator.types import Completion, StreamChunk, TokenIds
from metaloom.ledger import Ledger, Usage
from metaloom.server import protocol
from metaloom.server.errors import ApiError, api_error
from metaloom.server.metrics import Metrics
from metaloom.server.protocol import ChatBody, CompletionBody
from metaloom.server.scheduled import Cancelled, ScheduledGenerator
from metaloom.server.scheduler import Failed, Finished, Scheduler
from metaloom.server.strategy import StrategyCall, resolve_model

log = logging.getLogger("metaloom.server")


class BodyLimit:
    """An ASGI middleware refusing bodies over ``limit`` bytes with 413, declared or streamed."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = ApiError(413, f"request body over {self.limit} bytes", "invalid_request_error", code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_big.response()(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
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

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()
        workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="metaloom", version="0.1.0", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)

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

    @app.get("/health")
    def health() -> dict[str, Any]:
        s = scheduler.stats()
        return {"status": "ok", "waiting": s.waiting, "running_rows": s.running_rows}

    @app.get("/metrics")
    def prometheus() -> Response:
        s = scheduler.stats()
        metrics.queue_depth.set(s.waiting)
        metrics.running.set(s.running_rows)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": ids[0], "object": "model", "created": 0, "owned_by": "metaloom",
                                            "root": generator.loaded.name}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)], response_model=None)
    async def chat(body: ChatBody, request: Request) -> Any:  # type: ignore[valid-type]
        b: Any = body
        strategy = resolve_model(b.model, ids, b.metaloom)
        call = _Call(scheduler, metrics, workers, request, chat=True, model=b.model, logprobs=bool(b.logprobs))
        if strategy is not None:
            return await call.strategy(strategy, protocol.chat_request(body), b.stream, _usage_wanted(b))
        return await call.plain(call.fit([protocol.chat_request(body)], b), b.stream, _usage_wanted(b))

    @app.post("/v1/completions", dependencies=[Depends(authorised)], response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Any:  # type: ignore[valid-type]
        b: Any = body
        strategy = resolve_model(b.model, ids, b.metaloom)
        call = _Call(scheduler, metrics, workers, request, chat=False, model=b.model, logprobs=b.logprobs is not None)
        requests = protocol.completion_requests(body)
        if strategy is not None:
            if len(requests) != 1:
                raise ApiError(400, "a strategy takes one prompt", "invalid_request_error", param="prompt")
            return await call.strategy(strategy, requests[0], b.stream, _usage_wanted(b))
        return await call.plain(call.fit(requests, b), b.stream, _usage_wanted(b))

    return app


_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})


def _usage_wanted(body: Any) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)


class _Call:
    """One HTTP call's run: submit, wait or stream, build the OpenAI response."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, workers: ThreadPoolExecutor, http: Request, *,
                 chat: bool, model: str, logprobs: bool) -> None:
        self.scheduler, self.metrics, self.workers, self.http = scheduler, metrics, workers, http
        self.chat, self.model, self.logprobs = chat, model, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.tokenizer = scheduler.generator.tokenizer
        self.object = "chat.completion" if chat else "text_completion"

    # --- plain requests ----------------------------------------------------------------------
    def fit(self, requests: list[Any], body: Any) -> list[Any]:
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

    async def plain(self, requests: list[Any], stream: bool, include_usage: bool) -> Any:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        ledger = Ledger()
        tickets = []
        try:
            for i, r in enumerate(requests):  # all validated (a bad one raises: 400) before any compute
                def sink(event: Any, i: int = i) -> None:
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
        self._observe(ledger.usage, tickets)
        choices = [self._choice(i * n + j, c) for i in range(len(requests)) for j, c in enumerate(results[i])]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_block(ledger.usage)}

    async def _next(self, inbox: asyncio.Queue[Any]) -> Any:
        """The next event; a client that went away cancels the request (checked twice a second)."""
        while True:
            try:
                return await asyncio.wait_for(inbox.get(), timeout=0.5)
            except TimeoutError:
                if await self.http.is_disconnected():
                    raise Cancelled("client disconnected") from None

    async def _stream_plain(self, inbox: asyncio.Queue[Any], tickets: list[Any], ledger: Ledger, n: int,
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.chat:
                for j in range(n):
                    yield self._chunk(j, {"role": "assistant", "content": ""})
            finished = 0
            while finished < len(tickets):
                i, event = await inbox.get()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    finished += 1
                    continue
                assert isinstance(event, StreamChunk)
                yield self._delta(i * n + event.index, event)
            self._observe(ledger.usage, tickets)
            if include_usage:
                yield {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_block(ledger.usage)}
        finally:
            for t in tickets:
                t.cancel()

    # --- strategies -----------------------------------------------------------------------------
    async def strategy(self, call: StrategyCall, request: Any, stream: bool, include_usage: bool) -> Any:
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        prompt, sampling = request.prompt, request.params
        if sampling.n != 1:  # the rest was checked with the call (names, types, values); this needs the body
            raise InvalidParameter("n", sampling.n, "1 with a strategy (its samples are its own parameter, e.g. n)")
        tally = {"calls": 0, "samples_finished": 0, "output_tokens": 0}

        def on_done(completions: tuple[Completion, ...]) -> None:
            tally["calls"] += 1
            tally["samples_finished"] += len(completions)
            tally["output_tokens"] += sum(len(c.token_ids) for c in completions)
            loop.call_soon_threadsafe(progress.put_nowait, dict(tally))

        gen = ScheduledGenerator(self.scheduler, on_done=on_done)
        ledger = Ledger(budget=call.budget)
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

    async def _stream_strategy(self, call: StrategyCall, future: Any, progress: asyncio.Queue[dict[str, Any]],
                               gen: ScheduledGenerator, ledger: Ledger, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.chat:
                yield self._chunk(0, {"role": "assistant", "content": ""})
            while not future.done():
                getter = asyncio.ensure_future(progress.get())
                done, _ = await asyncio.wait({future, getter}, return_when=asyncio.FIRST_COMPLETED)
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

    def _delta(self, index: int, chunk: StreamChunk) -> dict[str, Any]:
        delta = ({"content": chunk.text} if chunk.text else {}) if self.chat else {"text": chunk.text}
        out = self._chunk(index, delta, chunk.finish_reason)
        choice = out["choices"][0]
        if self.logprobs and chunk.token_ids:
            choice["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs)
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.stop_reason
            if chunk.error is not None:
                choice["error"] = chunk.error
        return out

    def _choice(self, index: int, c: Completion) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason,
                                  "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.logprobs else None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        if c.error is not None:
            choice["error"] = c.error
        return choice

    def _strategy_choice(self, result: Any) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(result), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.best}
        else:
            choice["text"] = result.best
        return choice

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float]) -> dict[str, Any]:
        tokens = [self.tokenizer.decode([t]) for t in ids]
        values = [lp if lp == lp and lp != float("-inf") else -9999.0 for lp in lps]  # strict JSON has no NaN/-inf
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                for t, lp in zip(tokens, values, strict=True)]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}

    def _sse(self, events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:
                error = api_error(exc)
                if error.status >= 500:
                    log.error("error while streaming", exc_info=exc)
                yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.latency.labels("/v1/chat/completions" if self.chat else "/v1/completions").observe(
                time.perf_counter() - self.started)
        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _observe(self, usage: Usage, tickets: Sequence[Any]) -> None:
        self.metrics.prompt_tokens.inc(usage.input_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.completion_tokens.inc(usage.output_tokens)
        for t in tickets:
            if t.first_token_at is not None:
                self.metrics.ttft.observe(t.first_token_at - t.submitted)


def _finish(result: Any) -> str:
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
