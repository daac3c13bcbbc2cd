"""The OpenAI-compatible HTTP app (FastAPI): routes, errors in OpenAI's shape, auth, limits.

Plain requests go straight to the scheduler (continuous batching); a strategy (a ``metaloom``
object in the body, or a model alias ``majority_vote@n=8:default``) runs in a worker thread
against `ScheduledGenerator`, so its samples join the same decode loop (`metaloom.server.calls`).
Usage is the request's own ledger: prompt, completion and cached tokens, and a ``metaloom`` block
with forward passes, FLOPs, seconds and the rest.

Which routes need the API key (``--api-key``): every ``/v1`` route, ``/tokenize`` and
``/detokenize`` always; ``/health``, ``/metrics`` and the docs (``/docs``, ``/redoc``,
``/openapi.json``) only when ``open_routes`` leaves them out (by default all three are open).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.generator.local import LocalGenerator
from metaloom.generator.plan import check_ids
from metaloom.ledger import Ledger
from metaloom.server import bodies, protocol
from metaloom.server.bodies import ChatBody, ChatFields, CompletionBody, CompletionFields
from metaloom.server.calls import Call, StrategyGate
from metaloom.server.errors import ApiError, api_error
from metaloom.server.http import Observed, ReadBody
from metaloom.server.limits import MAX_PREFILL_TOKENS, OPEN_ROUTES, Limits
from metaloom.server.memory import memory_parts, size_pools, storage_parts
from metaloom.server.metrics import Metrics
from metaloom.server.scheduler import Scheduler
from metaloom.server.strategy import resolve_model

log = logging.getLogger("metaloom.server")
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/limits", "/health", "/metrics",
                     "/tokenize", "/detokenize"})


@dataclass
class Served:
    """What the routes share: the engine and its scheduler, the limits, the settings."""

    generator: LocalGenerator
    scheduler: Scheduler
    metrics: Metrics
    workers: ThreadPoolExecutor
    gate: StrategyGate
    limits: Limits
    ids: tuple[str, ...]
    settings: dict[str, int]  # max_rows, max_waiting, max_body_bytes, max_prefill_tokens: reported by /v1/limits
    weights: dict[str, int]
    authorised: Callable[[Request], None]

    @property
    def context(self) -> int:
        return self.generator.model.max_context

    def call(self, request: Request, *, chat: bool, model: str, logprobs: bool, token_ids: bool) -> Call:
        return Call(self.scheduler, self.metrics, self.workers, request, self.limits, self.gate, chat=chat, model=model,
                    logprobs=logprobs, token_ids=token_ids)


def create_app(generator: LocalGenerator, *, model_ids: Sequence[str], api_key: str | None = None,
               max_rows: int = 64, max_waiting: int = 256, max_body_bytes: int = 4 << 20,
               strategy_workers: int = 8, limits: Limits | None = None, body_timeout: float = 30.0,
               open_routes: Sequence[str] = OPEN_ROUTES, kv_pool_bytes: int | None = None,
               max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> FastAPI:
    """The server for ``generator``, answering to ``model_ids`` (the first is the listed id);
    ``limits``: what one request may ask for (`metaloom.server.limits.Limits`, its defaults);
    ``open_routes``: of health, metrics and docs, those served without the key; ``kv_pool_bytes``:
    the most the KV pool may hold (default: half the memory available at the start);
    ``max_prefill_tokens``: prompt tokens admitted between two decode steps (`Scheduler`)."""
    unknown = sorted(set(open_routes) - set(OPEN_ROUTES))
    if unknown:
        raise InvalidParameter("open_routes", unknown[0], f"some of {list(OPEN_ROUTES)}")
    limits = limits or Limits()
    metrics = Metrics()
    scheduler = Scheduler(generator, max_rows=max_rows, max_waiting=max_waiting, max_prefill_tokens=max_prefill_tokens,
                          on_step=lambda rows: metrics.batch_size.observe(rows), limits=limits)
    workers = ThreadPoolExecutor(max_workers=strategy_workers, thread_name_prefix="metaloom-strategy")
    size_pools(generator, max_rows, cap_bytes=kv_pool_bytes)
    served = Served(generator, scheduler, metrics, workers, StrategyGate(strategy_workers, max_waiting), limits,
                    tuple(model_ids), {"max_rows": max_rows, "max_waiting": max_waiting, "max_body_bytes": max_body_bytes,
                                       "max_prefill_tokens": max_prefill_tokens},
                    storage_parts([generator.model, generator.amateur]), _key_check(api_key))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()
        workers.shutdown(wait=False, cancel_futures=True)

    docs_open = api_key is None or "docs" in open_routes
    app = FastAPI(title="metaloom", version="0.1.0", lifespan=lifespan, docs_url="/docs" if docs_open else None,
                  redoc_url="/redoc" if docs_open else None, openapi_url="/openapi.json" if docs_open else None)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(ReadBody, limit=max_body_bytes, timeout=body_timeout)
    app.add_middleware(Observed, observe=_observer(metrics))
    _errors(app)
    guard = {route: [] if route in open_routes else [Depends(served.authorised)] for route in OPEN_ROUTES}
    _status_routes(app, served, guard)
    if not docs_open:
        _guarded_docs(app, served)
    _model_routes(app, served)
    _generation_routes(app, served)
    return app


def _key_check(api_key: str | None) -> Callable[[Request], None]:
    def authorised(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_request_error",
                           code="invalid_api_key")
    return authorised


def _observer(metrics: Metrics) -> Callable[[str, int, float, bool], None]:
    def observe(path: str, status: int, seconds: float, streamed: bool) -> None:
        route = path if path in _ROUTES else "other"
        metrics.requests.labels(route, str(status)).inc()
        if not streamed:  # a stream's latency: at its end (`Responder._sse`)
            metrics.latency.labels(route).observe(seconds)
    return observe


def _errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape, with the status that says who must act (`api_error`)."""

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
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        if first.get("type", "") == "extra_forbidden":
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


def _status_routes(app: FastAPI, s: Served, guard: dict[str, list[Any]]) -> None:
    scheduler, metrics = s.scheduler, s.metrics

    @app.get("/health", response_model=None, dependencies=guard["health"])
    def health() -> Any:
        st = scheduler.stats()
        body = {"status": "draining" if scheduler.draining else "ok", "waiting": st.waiting,
                "running_rows": st.running_rows, "prefilling_rows": st.prefilling_rows, "preemptions": st.preemptions}
        return JSONResponse(body, status_code=503) if scheduler.draining else body

    @app.get("/metrics", dependencies=guard["metrics"])
    def prometheus() -> Response:
        st = scheduler.stats()
        metrics.queue_depth.set(st.waiting)
        metrics.running.set(st.running_rows)
        metrics.prefilling.set(st.prefilling_rows)
        metrics.preemptions.set(st.preemptions)
        for part, value in memory_parts(s.generator, s.weights).items():
            metrics.memory.labels(part).set(value)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _guarded_docs(app: FastAPI, s: Served) -> None:
    """The docs behind the key (``open_routes`` without "docs")."""

    @app.get("/openapi.json", dependencies=[Depends(s.authorised)], include_in_schema=False)
    def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", dependencies=[Depends(s.authorised)], include_in_schema=False)
    def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="metaloom")


def _model_routes(app: FastAPI, s: Served) -> None:
    key = [Depends(s.authorised)]

    def card(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "metaloom", "root": s.generator.loaded.name,
                "max_model_len": s.context, "metaloom": {"limits": s.limits.report(s.context)}}

    @app.get("/v1/limits", dependencies=key)
    def limits() -> dict[str, Any]:
        """What one request may ask for (a 400 names the limit it passed), and the decode loop's
        capacity: rows decoded together, requests that may wait, the KV pool's slots."""
        pool = s.generator.pool
        kv = None if pool is None else {"max_slots": pool.max_slots, "bytes_per_slot": pool.bytes_per_slot}
        return {"object": "limits", **s.limits.report(s.context), **s.settings, "kv_pool": kv}

    @app.get("/v1/models", dependencies=key)
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(s.ids[0])]}

    @app.get("/v1/models/{model_id:path}", dependencies=key)
    def model(model_id: str) -> dict[str, Any]:
        """OpenAI's retrieve: a served id, or a strategy alias of one (STRATEGY@param=v,...:ID); 404 else."""
        resolve_model(model_id, s.ids, None)
        return card(model_id)

    @app.post("/tokenize", dependencies=key)
    def tokenize(body: bodies.TokenizeBody) -> dict[str, Any]:
        """Token ids as the server would read the prompt (vLLM's route and shapes)."""
        if body.model is not None:
            resolve_model(body.model, s.ids, None)  # 404 for a model not served
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameter("prompt", body.prompt, "exactly one of prompt and messages")
        protocol.valid_text(body.model_dump(exclude_none=True), "")
        s.limits.check_tools(body.tools)
        tokenizer = s.generator.tokenizer
        text, special = protocol.tokenize_text(body, tokenizer)
        tokens = tokenizer.encode(text, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(tokens), "max_model_len": s.context, "tokens": tokens}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
        return out

    @app.post("/detokenize", dependencies=key)
    def detokenize(body: bodies.DetokenizeBody) -> dict[str, Any]:
        if body.model is not None:
            resolve_model(body.model, s.ids, None)
        check_ids("tokens", body.tokens, s.generator.model.vocab_size)
        return {"prompt": s.generator.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _generation_routes(app: FastAPI, s: Served) -> None:
    def admitting() -> None:
        """New work is refused once a shutdown began (work already in flight drains)."""
        if s.scheduler.draining:
            raise ApiError(503, "server shutting down: not accepting new requests", "server_error", code="shutting_down")

    checks = [Depends(s.authorised), Depends(admitting)]

    @app.post("/v1/chat/completions", dependencies=checks, response_model=None)
    async def chat(body: ChatBody, request: Request) -> Response | dict[str, Any]:  # type: ignore[valid-type]
        b = cast(ChatFields, body)
        strategy = resolve_model(b.model, s.ids, b.metaloom)
        s.limits.check_tools(b.tools)
        call = s.call(request, chat=True, model=b.model, logprobs=bool(b.logprobs), token_ids=b.return_tokens_as_token_ids)
        call.continuous_usage = _continuous_usage(b)
        if strategy is not None:
            strategy = strategy.within(s.limits, s.context)
            if protocol.calls_tools(body):
                raise InvalidParameter("tools", "set", "not set with a strategy (function calling is for plain requests)")
            return await call.strategy(strategy, protocol.chat_request(body)[0], b.stream, _usage_wanted(b))
        wanted, call.tools = protocol.chat_request(body, s.generator.tokenizer)
        named = protocol.named_constraint(body)
        call.constraint_field = "tools" if call.tools else (named[0] if named is not None else None)
        return await call.plain(call.fit([wanted], b), b.stream, _usage_wanted(b), Ledger())

    @app.post("/v1/completions", dependencies=checks, response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response | dict[str, Any]:  # type: ignore[valid-type]
        b = cast(CompletionFields, body)
        strategy = resolve_model(b.model, s.ids, b.metaloom)
        call = s.call(request, chat=False, model=b.model, logprobs=b.logprobs is not None,
                      token_ids=b.return_tokens_as_token_ids)
        call.continuous_usage = _continuous_usage(b)
        requests = protocol.completion_requests(body)
        named = protocol.named_constraint(body)
        call.constraint_field = named[0] if named is not None else None
        k, only = protocol.prompt_logprobs(body), protocol.scores_only(body)
        if strategy is not None:
            strategy = strategy.within(s.limits, s.context)
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


def _continuous_usage(body: ChatFields | CompletionFields) -> bool:
    return bool(body.stream_options is not None and body.stream_options.continuous_usage_stats)


def _usage_wanted(body: ChatFields | CompletionFields) -> bool:
    return bool(body.stream_options is not None and body.stream_options.include_usage)
