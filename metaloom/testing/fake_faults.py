"""The faults the fake OpenAI-compatible server (`metaloom.testing.fake_openai`) can play, and the
ASGI middleware that plays them: each `Fault` is taken, in order, by the first request it
matches — a status (with Retry-After), a delay, a dropped connection (mid-body), a malformed
body, a stream cut after some events. The middleware also logs every request (path, body) as
it arrived, faulted or not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from metaloom.testing.fake_openai import FakeOpenAI

GENERATION = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Fault:
    """``kind``: "status" (answer ``status`` with ``message``, and ``retry_after`` as the
    Retry-After header), "delay" (wait ``seconds``, then serve), "drop" (close the connection
    mid-body), "malformed" (200 with a body that is not JSON), "cut" (a stream that breaks off
    after ``events`` events). ``path``: only requests to it (default: the generation routes)."""

    kind: str
    status: int = 500
    message: str = "injected fault"
    retry_after: str | None = None
    seconds: float = 0.0
    events: int = 1
    path: str | None = None

    def matches(self, path: str) -> bool:
        return path == self.path if self.path is not None else path in GENERATION



def error_response(status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error answer: ``status``, with the message and the parameter it names."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                                   "param": param, "code": None}}, status_code=status, headers=dict(headers or {}))


@dataclass
class Faults:
    """ASGI middleware: logs every request, then plays the first fault that matches it."""

    app: Any
    server: FakeOpenAI

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        path = scope["path"]
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        self.server.log.append((path, body))
        self.server.active += 1
        try:
            await self._serve(path, raw, scope, receive, send)
        finally:
            self.server.active -= 1

    async def _serve(self, path: str, raw: bytes, scope: Any, receive: Any, send: Any) -> None:
        fault = next((f for f in self.server.faults if f.matches(path)), None)
        if fault is not None:
            self.server.faults.remove(fault)
            if await self._play(fault, scope, send):
                return

        given = [False]

        async def replay() -> Any:  # the body once, then what the connection says (a disconnect)
            if given[0]:
                return await receive()
            given[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send if fault is None or fault.kind != "cut" else _cut(send, fault.events))

    async def _play(self, fault: Fault, scope: Any, send: Any) -> bool:
        """Play ``fault``; True if it answered the request itself."""
        if fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            return False
        if fault.kind == "status":
            headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else None
            await error_response(fault.status, fault.message, headers=headers)(scope, _nothing, send)
            return True
        if fault.kind == "malformed":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")]})
            await send({"type": "http.response.body", "body": b'{"choices": '})
            return True
        if fault.kind == "drop":  # promises a longer body than it sends: the client sees the connection cut
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]})
            await send({"type": "http.response.body", "body": b'{"id": "cut', "more_body": True})
            raise _Dropped
        return False  # "cut": served, through a send that breaks off


class _Dropped(Exception):
    """Raised inside the app to make the server abort the connection."""


async def _nothing() -> Any:
    return {"type": "http.disconnect"}


def _cut(send: Any, events: int) -> Any:
    """A ``send`` that lets ``events`` stream events through, then breaks the connection."""
    seen = [0]

    async def cutting(message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body", b"").startswith(b"data:"):
            if seen[0] >= events:
                raise _Dropped
            seen[0] += 1
        await send(message)
    return cutting
