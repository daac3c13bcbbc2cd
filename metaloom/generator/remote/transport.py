"""The HTTP side of `RemoteGenerator`: a private event loop, the official `openai` client with
its own retries off, and metaloom's retry policy on top (so it can be tested and tuned).

Why an async client on a private loop thread, not the sync client on a thread pool: every call
from every caller thread shares one connection pool and one concurrency bound (a semaphore);
cancelling an asyncio task closes its HTTP connection at once, which is how a server learns to
stop generating (a thread blocked in a sync read cannot be interrupted); and hundreds of
outstanding requests cost hundreds of tasks, not hundreds of threads. The `Generator` protocol
stays synchronous: `EventLoopThread.run` submits a coroutine and waits for it.

Retries (`RetryPolicy`): on 429 (honouring Retry-After), 5xx, a lost connection (in the end a
`ServerUnreachable`) and an unreadable body; exponential backoff with jitter. Never on another
4xx (the request itself is wrong: a `RemoteError` carrying the server's message) nor on a
timeout (a `RemoteTimeout`: the server may still be computing the answer, and a retry would
double its load).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import openai

from metaloom.errors import InvalidParameter, RemoteError, RemoteTimeout, ServerUnreachable

T = TypeVar("T")
Json = dict[str, Any]


class EventLoopThread:
    """An asyncio loop running in a daemon thread; `run` executes a coroutine on it from any
    other thread and returns its result (an interrupted wait cancels the coroutine)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a RemoteGenerator method was called from its own event loop thread")
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("this RemoteGenerator is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a KeyboardInterrupt in the caller cancels the request (and closes its connection)
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass(frozen=True)
class RetryPolicy:
    """Retry number ``k`` (from 0) waits ``min(max_delay, base_delay * 2**k)``, shortened by up
    to ``jitter`` (a fraction, drawn at random) so that many clients do not retry in step; a
    Retry-After header replaces that wait, unless it asks for more than ``max_retry_after``
    seconds (then the error is raised at once: waiting that long is the caller's decision)."""

    max_retries: int = 3
    base_delay: float = 0.5
    max_delay: float = 30.0
    jitter: float = 0.25
    max_retry_after: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_retries, int) or isinstance(self.max_retries, bool) or self.max_retries < 0:
            raise InvalidParameter("max_retries", self.max_retries, "an integer >= 0")
        for name in ("base_delay", "max_delay", "max_retry_after"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise InvalidParameter(name, value, "a finite number of seconds >= 0")
        if not isinstance(self.jitter, (int, float)) or not 0.0 <= self.jitter <= 1.0:
            raise InvalidParameter("jitter", self.jitter, "a fraction in [0, 1]")

    def delay(self, retry: int, retry_after: float | None, draw: float) -> float | None:
        """Seconds to wait before retry number ``retry`` (0 = the first), or None to give up.
        ``draw``: a uniform number in [0, 1) for the jitter."""
        if retry >= self.max_retries:
            return None
        if retry_after is not None:
            return max(0.0, retry_after) if retry_after <= self.max_retry_after else None
        return min(self.max_delay, self.base_delay * 2.0 ** retry) * (1.0 - self.jitter * draw)


def retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds a Retry-After (or retry-after-ms) header asks for: a number or an HTTP date."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - time.time()


class Malformed(Exception):
    """A 2xx answer whose body is not what the route returns (cut off, not JSON, wrong shape)."""


@dataclass(frozen=True)
class Failure:
    """What a failed attempt means: the typed error, whether to retry, and the wait asked for."""

    error: RemoteError
    retry: bool
    wait: float | None = None


RETRY_STATUSES = frozenset({429})  # and every 5xx


def classify(exc: BaseException, url: str) -> Failure:
    """The typed error behind an exception from the client, and whether it may be retried."""
    if isinstance(exc, openai.APITimeoutError):
        return Failure(RemoteTimeout(url, "no answer within the timeout"), retry=False)
    if isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__ or exc
        return Failure(ServerUnreachable(url, f"connection failed: {type(cause).__name__}: {cause}"), retry=True)
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        message, param, code = server_message(exc.body, exc.message)
        error = RemoteError(url, message, status, param=param, code=code)
        if status in RETRY_STATUSES or status >= 500:
            return Failure(error, retry=True, wait=retry_after(exc.response.headers))
        return Failure(error, retry=False)
    if isinstance(exc, (Malformed, json.JSONDecodeError)):
        return Failure(RemoteError(url, f"unreadable answer: {exc}"), retry=True)
    if isinstance(exc, openai.APIError):  # an error event inside a stream: the server's verdict
        message, param, code = server_message(exc.body, exc.message)
        return Failure(RemoteError(url, message, param=param, code=code), retry=False)
    raise exc


def server_message(body: object, fallback: str) -> tuple[str, str | None, str | None]:
    """The server's message, param and code from an OpenAI-shaped error body (or its text)."""
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = error.get("message")
        param, code = error.get("param"), error.get("code")
        return (str(message) if message else fallback, str(param) if param is not None else None,
                str(code) if code is not None else None)
    if isinstance(body, str) and body:
        return body, None, None
    return fallback, None, None


def split_base_url(base_url: str) -> tuple[str, str]:
    """(OpenAI API root ``.../v1``, server root): vLLM serves /tokenize beside /v1, not under it.
    Either form may be given."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        return url, url[: -len("/v1")]
    return url + "/v1", url


class Transport:
    """JSON requests and SSE streams to one server, bounded to ``max_concurrency`` at once, with
    `RetryPolicy` retries. Lives on (and must be used from) one event loop; ``open`` first.

    Paths starting with "/" are under the server root (``/tokenize``), others under the API
    root (``chat/completions``)."""

    def __init__(self, base_url: str, api_key: str | None, *, timeout: float, retry: RetryPolicy,
                 max_concurrency: int, rng: random.Random | None = None) -> None:
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise InvalidParameter("max_concurrency", max_concurrency, "an integer >= 1")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise InvalidParameter("timeout", timeout, "a number of seconds > 0")
        self.api_url, self.root_url = split_base_url(base_url)
        self.api_key = api_key or "EMPTY"  # local servers take any key; the client insists on one
        self.timeout = float(timeout)
        self.retry = retry
        self.max_concurrency = max_concurrency
        self.rng = rng or random.Random()
        self.client: openai.AsyncOpenAI | None = None
        self.slots: asyncio.Semaphore | None = None

    async def open(self) -> None:
        # max_retries=0: the client's own retry policy (which also retries 408/409 and timeouts)
        # is off; `RetryPolicy` decides, the same way on every route
        self.client = openai.AsyncOpenAI(base_url=self.api_url, api_key=self.api_key, timeout=self.timeout, max_retries=0)
        self.slots = asyncio.Semaphore(self.max_concurrency)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    def url(self, path: str) -> str:
        return self.root_url + path if path.startswith("/") else f"{self.api_url}/{path}"

    async def get(self, path: str, shape: Callable[[Json], None] | None = None) -> Json:
        client = self._client()
        return await self._retrying(path, lambda: self._json(client.get(self.url(path), cast_to=object), shape))

    async def post(self, path: str, body: Json, shape: Callable[[Json], None] | None = None) -> Json:
        client = self._client()
        return await self._retrying(path, lambda: self._json(client.post(self.url(path), body=body, cast_to=object), shape))

    async def events(self, path: str, body: Json) -> AsyncGenerator[Json, None]:
        """The JSON events of an SSE response. Failures before the first event are retried;
        later ones raise (what was yielded cannot be taken back). Closing this iterator closes
        the connection: the server sees its client go and stops generating."""
        client = self._client()
        assert self.slots is not None
        # the slot is taken by a successful opening and held until the stream is closed
        stream, first = await self._retrying(path, lambda: self._open_stream(client, path, body), slot=False)
        try:
            if first is None:
                return
            yield first
            while True:
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except (openai.APIError, json.JSONDecodeError) as exc:
                    raise self._mid_stream(path, exc) from exc
                if not isinstance(event, dict):
                    raise RemoteError(self.url(path), f"unreadable stream event: {event!r:.200}")
                yield event
        finally:
            try:
                await stream.close()
            finally:
                self.slots.release()

    # --- internals -------------------------------------------------------------------------------
    def _client(self) -> openai.AsyncOpenAI:
        if self.client is None:
            raise RuntimeError("Transport.open() was not called")
        return self.client

    def _mid_stream(self, path: str, exc: BaseException) -> RemoteError:
        error = classify(exc, self.url(path)).error
        if isinstance(error, ServerUnreachable):
            return ServerUnreachable(error.url, f"the stream broke off: {error.message}")
        return error

    @staticmethod
    async def _json(call: Awaitable[object], shape: Callable[[Json], None] | None) -> Json:
        data = await call
        if not isinstance(data, dict):
            raise Malformed(f"expected a JSON object, got {data!r:.200}")
        if shape is not None:
            shape(data)
        return data

    async def _open_stream(self, client: openai.AsyncOpenAI, path: str, body: Json) -> tuple[Any, Json | None]:
        """Open the stream and read its first event, holding a slot (kept on success)."""
        assert self.slots is not None
        await self.slots.acquire()
        stream: Any = None
        try:
            stream = await client.post(self.url(path), body=body, cast_to=object, stream=True,
                                       stream_cls=openai.AsyncStream[object])
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return stream, None
            if not isinstance(first, dict):
                raise Malformed(f"expected a JSON event, got {first!r:.200}")
            return stream, first
        except BaseException:
            if stream is not None:
                await stream.close()
            self.slots.release()
            raise

    async def _retrying(self, path: str, attempt: Callable[[], Awaitable[T]], *, slot: bool = True) -> T:
        """Run ``attempt`` (holding a concurrency slot unless the caller holds one) until it
        succeeds or `RetryPolicy` gives up; the slot is released while waiting to retry."""
        assert self.slots is not None
        tries = 0
        while True:
            try:
                if slot:
                    async with self.slots:
                        return await attempt()
                return await attempt()
            except (openai.APIError, Malformed, json.JSONDecodeError) as exc:
                failure = classify(exc, self.url(path))
                wait = self.retry.delay(tries, failure.wait, self.rng.random()) if failure.retry else None
                tries += 1
                if wait is None:
                    raise _with_attempts(failure.error, tries) from exc
            await asyncio.sleep(wait)


def _with_attempts(error: RemoteError, attempts: int) -> RemoteError:
    """The same error, its message counting the attempts."""
    return type(error)(error.url, error.message, error.status, attempts=attempts, param=error.param, code=error.code)
