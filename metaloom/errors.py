"""Typed errors. Every error says which parameter, what value, and what is allowed.

The CLI and server turn any `MetaloomError` into one clear line and a non-zero exit / 4xx,
so library code raises these instead of returning error strings or clamping silently.
"""

from __future__ import annotations

from typing import Any


class MetaloomError(Exception):
    """Base class of every error metaloom raises on purpose."""


class InvalidParameter(MetaloomError, ValueError):
    """A parameter is outside what is allowed."""

    def __init__(self, name: str, value: Any, allowed: str) -> None:
        self.name = name
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {name}={value!r}: allowed {allowed}")


class ModelNotFound(MetaloomError, FileNotFoundError):
    """The model path does not exist or the default model package is not installed."""


class NotAModel(MetaloomError):
    """The path exists but is not a model metaloom can load."""


class UnsupportedModel(MetaloomError):
    """A real model whose architecture or feature metaloom does not implement."""


class UnsupportedISA(MetaloomError):
    """A kernel instruction-set path (``METALOOM_ISA``) that is no path or that this CPU cannot
    run; the message names what the CPU has and the paths it runs."""


class KernelPathWarning(RuntimeWarning):
    """The C kernels for the instruction-set path this CPU should run did not build (a compiler
    without the path's flags, a source that does not compile), and a slower path runs instead."""


class ContextWindowExceeded(MetaloomError):
    """Prompt plus requested tokens do not fit the model's context window."""

    def __init__(self, needed: int, window: int, what: str = "prompt") -> None:
        self.needed = needed
        self.window = window
        super().__init__(
            f"{what} needs {needed} tokens but the model's context window is {window}"
        )


class CacheFull(MetaloomError):
    """A KV cache was asked to hold more tokens than its capacity."""


class BudgetExceeded(MetaloomError):
    """A ledger charge would pass a budget limit."""

    def __init__(self, field: str, limit: float, would_be: float) -> None:
        self.field = field
        self.limit = limit
        self.would_be = would_be
        super().__init__(f"budget exceeded: {field} would be {would_be} > limit {limit}")


class Interrupted(MetaloomError):
    """A run was stopped from outside between two forwards (`Ledger.stop`: a server shutting
    down, a client gone); what it did until then is charged."""


class ScorerFailed(MetaloomError):
    """A scorer (verifier, reward model, judge, utility) raised. Names the scorer; a strategy
    attaches what it had gathered so far as ``partial`` (a `metaloom.meta.Result`)."""

    def __init__(self, scorer: str, cause: BaseException, partial: Any = None) -> None:
        self.scorer = scorer
        self.cause = cause
        self.partial = partial
        super().__init__(f"scorer {scorer!r} failed: {type(cause).__name__}: {cause}")


class InvalidGrammar(MetaloomError, ValueError):
    """A constraint (JSON Schema, regular expression, Lark grammar, choice list) that the
    grammar engine rejects or that no text satisfies. Raised before any token is generated."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"invalid {kind} constraint: {detail}")


class NoSpeculatorHeads(UnsupportedModel):
    """Speculator heads were asked for a model that has none shipped and no heads file was given."""


class Unsupported(MetaloomError):
    """A request asks for something this generator cannot do (a sampling parameter, a decoder,
    a constraint kind, a feature such as token-id prompts or scoring). Raised before any
    compute; never silently ignored. ``field`` names what was asked for."""

    def __init__(self, field: str, generator: str, detail: str = "") -> None:
        self.field = field
        self.generator = generator
        self.detail = detail
        super().__init__(f"unsupported {field}: {generator} cannot serve it" + (f" ({detail})" if detail else ""))


class RemoteError(MetaloomError):
    """A remote server refused or failed a request. ``status``: the HTTP status (None when no
    answer came: a lost connection, an unreadable body, an error event mid-stream);
    ``message``: the server's own words; ``attempts``: how many times it was sent."""

    def __init__(self, url: str, message: str, status: int | None = None, *, attempts: int = 1,
                 param: str | None = None, code: str | None = None) -> None:
        self.url = url
        self.message = message
        self.status = status
        self.attempts = attempts
        self.param = param
        self.code = code
        where = f"{url} answered {status}" if status is not None else f"{url} failed"
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{where}{tries}: {message}")


class ServerUnreachable(RemoteError):
    """No connection to a remote server after the retries: refused, reset, or closed before or
    while it answered (a server that is down or went away, never read as a feature it lacks or
    a request it refused). ``message`` names the underlying cause. The CLI exits with status 3
    (`metaloom.cli.EXIT_UNREACHABLE`), not 2 (bad input)."""

    def __init__(self, url: str, message: str, status: int | None = None, *, attempts: int = 1,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(url, message, status, attempts=attempts, param=param, code=code)
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        self.args = (f"cannot reach the server at {url}{tries}: {message}",)


class RemoteTimeout(RemoteError):
    """A remote request got no answer within its timeout (not retried: the server may still be
    working on it)."""
