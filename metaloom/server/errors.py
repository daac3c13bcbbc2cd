"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
that says who must act: 400 the caller's parameters (naming the field), 401, 404 an unknown model,
413 an oversized body, 429 overloaded (with Retry-After), 503 shutting down, 502/504 a server behind this one failed
or did not answer, 500 only for a bug (logged server-side
with its traceback; the client gets no internals)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from metaloom.errors import (
    BudgetExceeded,
    ContextWindowExceeded,
    InvalidGrammar,
    InvalidParameter,
    MetaloomError,
    RemoteError,
    RemoteTimeout,
    Unsupported,
)
from metaloom.server.admission import Overloaded
from metaloom.server.tickets import Cancelled, ShuttingDown


class ApiError(Exception):
    """An error with an HTTP status, in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP face of an exception: 400 for what the caller can fix, 429 overloaded, 500 a bug."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), "rate_limit_exceeded", code="overloaded",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, Cancelled):  # nobody is there to read it: nginx's "client closed request", for the logs
        return ApiError(499, str(exc), "invalid_request_error", code="client_closed_request")
    if isinstance(exc, ShuttingDown):
        return ApiError(503, str(exc), "server_error", code="shutting_down")
    if isinstance(exc, RemoteTimeout):  # a server behind this one (a remote judge, ...) did not answer
        return ApiError(504, str(exc), "server_error", code="upstream_timeout")
    if isinstance(exc, RemoteError):
        return ApiError(502, str(exc), "server_error", code="upstream_error")
    if isinstance(exc, InvalidParameter):
        return ApiError(400, str(exc), "invalid_request_error", param=exc.name)
    if isinstance(exc, Unsupported):
        return ApiError(400, str(exc), "invalid_request_error", param=getattr(exc, "field", None), code="unsupported")
    if isinstance(exc, InvalidGrammar | ContextWindowExceeded | BudgetExceeded | MetaloomError):
        return ApiError(400, str(exc), "invalid_request_error")
    return ApiError(500, "internal server error (logged on the server)", "server_error")
