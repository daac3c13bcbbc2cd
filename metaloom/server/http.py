"""The HTTP edge: clients that send slowly, send too much, or go away.

- `ReadBody` reads a request's whole body before the app sees it: over ``limit`` bytes (declared
  or streamed) is a 413, a body that stops arriving (shorter than its Content-Length, or a
  client sending a byte a minute) is a 408 after ``timeout`` seconds, and headers over
  ``header_limit`` bytes in all are a 431. Without it a short body held a worker forever.
- `Observed` counts requests and their latency for ``/metrics`` as plain ASGI: Starlette's
  ``BaseHTTPMiddleware`` wraps ``receive``, and behind it a handler could not see its client
  disconnect (a non-streamed request then decoded to its end for nobody).
- `guarded_protocol`: uvicorn's h11 protocol with a deadline for a request's head (408 when the
  headers do not arrive in time: slowloris) and a 431 for a head larger than h11 will buffer
  (uvicorn answers a bare 400 there).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from metaloom.server.errors import ApiError

HEADER_LIMIT = 32 << 10  # bytes of request head (h11's own default is 16 KiB for an incomplete one)


class ReadBody:
    """An ASGI middleware that reads the body first (see the module docstring)."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float = 30.0, header_limit: int = HEADER_LIMIT) -> None:
        self.app, self.limit, self.timeout, self.header_limit = app, limit, timeout, header_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        if sum(len(k) + len(v) for k, v in headers) > self.header_limit:
            await _refuse(send, 431, f"request headers over {self.header_limit} bytes", "headers_too_large")
            return
        declared = dict(headers).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _refuse(send, 413, f"request body over {self.limit} bytes", "body_too_large")
            return
        chunks: list[bytes] = []
        seen, deadline = 0, time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await _refuse(send, 408, f"request body not received within {self.timeout:g} s "
                              "(shorter than its Content-Length, or sent too slowly)", "request_timeout")
                return
            if message["type"] == "http.disconnect":
                return  # the client left before its request was whole: nothing to answer
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:
                await _refuse(send, 413, f"request body over {self.limit} bytes", "body_too_large")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            # the body once, then the server's own receive: a disconnect is seen as it happens
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    response = ApiError(status, message, "invalid_request_error", code=code).response()
    response.headers["connection"] = "close"
    await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


class Observed:
    """An ASGI middleware calling ``observe(path, status, seconds, streamed)`` once a response
    has started (a stream's latency is its handler's to record, at its end)."""

    def __init__(self, app: ASGIApp, observe: Callable[[str, int, float, bool], None]) -> None:
        self.app, self.observe = app, observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        path = scope.get("path", "")

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                streamed = any(k == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in message.get("headers", []))
                self.observe(path, int(message["status"]), time.perf_counter() - started, streamed)
            await send(message)

        await self.app(scope, receive, sending)


LINGER = 2.0  # seconds a refused connection is read and dropped before it is closed


def guarded_protocol(header_timeout: float = 10.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a 408 for a request head not received within
    ``header_timeout`` seconds and a 431 for one larger than h11 buffers."""

    class Guarded(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _lingering = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                return  # answered and closing: the rest of what the client sends is read and dropped
            if self.conn.their_state is h11.IDLE and self._head_timer is None:
                self._arm()  # a keep-alive connection's next request: its head has a deadline too
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            buffered = len(self.conn.trailing_data[0])
            if buffered >= self.conn._max_incomplete_event_size:  # the head outgrew h11's buffer
                self._send_plain(431, b"Request Header Fields Too Large", b"request headers too large")
                return
            super().send_400_response(msg)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(header_timeout, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE or self.conn.our_state is not h11.IDLE:
                return
            if not self.conn.trailing_data[0]:
                self.transport.close()  # an idle keep-alive connection: nothing was asked
                return
            self._send_plain(408, b"Request Timeout", b"request headers not received in time")

        def _send_plain(self, status: int, reason: bytes, body: bytes) -> None:
            head = (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n") % (status, reason, len(body))
            self.transport.write(head + body)
            if not self.transport.can_write_eof():
                self.transport.close()
                return
            # a lingering close (as nginx does): closing with the client's bytes still unread makes
            # the kernel reset the connection, and a reset can discard the answer before the client
            # reads it; so stop writing, drop what still arrives, and close after LINGER seconds
            self._lingering = True
            self.transport.write_eof()
            self.transport.resume_reading()  # uvicorn may have paused it: the client's bytes must drain
            self.loop.call_later(LINGER, self.transport.close)

    return Guarded


def uvicorn_config(app: Any, host: str, port: int, *, header_timeout: float = 10.0, **options: Any) -> Any:
    """uvicorn's configuration for the server: the guarded protocol and head limit (the command
    and the tests' servers both use this)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(header_timeout),
                          h11_max_incomplete_event_size=HEADER_LIMIT, **options)
