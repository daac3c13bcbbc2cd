"""What a tool is, and the one way a strategy calls one.

A tool is a name, a one-line description, a JSON Schema of its arguments (an object) and
``call(arguments) -> str``. What it returns is the *observation* the model reads next. A tool
that refuses its input raises `ToolError`; any other exception, or a call that outlives its
time limit, is caught by `call_tool` and becomes an error observation too: a tool never
crashes the strategy that called it (Yao et al. 2023, ReAct, feed tool errors back the same
way).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from metaloom.errors import BudgetExceeded, Interrupted, InvalidParameter, MetaloomError


class ToolError(MetaloomError):
    """A tool refused its arguments or could not do what they ask (a division by zero, a
    name the calculator does not know); the message is what the model is shown."""


@runtime_checkable
class Tool(Protocol):
    """A callable tool. ``schema`` is the JSON Schema of ``call``'s ``arguments`` (an object
    schema), used both to describe the tool to the model and to constrain what it writes."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def schema(self) -> Mapping[str, Any]: ...

    def call(self, arguments: Mapping[str, Any]) -> str: ...


@dataclass(frozen=True)
class ToolSettings:
    """What the registry's factories may need: ``corpus`` for ``search`` (a path to a text or
    JSONL file, one document a line), ``top_k`` documents it returns, ``timeout_s`` for one
    call (the ``python`` tool's sandbox limit)."""

    corpus: str | None = None
    top_k: int = 3
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise InvalidParameter("top_k", self.top_k, "an integer >= 1")
        ok = isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
        if not (ok and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise InvalidParameter("tool_timeout_s", self.timeout_s, "a finite number of seconds > 0")


@dataclass(frozen=True)
class Observation:
    """The outcome of one tool call: ``text`` (what the model sees), ``ok`` (False: an error
    or a timeout, whose text starts with "Error"), wall ``seconds``."""

    text: str
    ok: bool
    seconds: float


GRACE_S = 2.0  # a tool that enforces its own limit (the sandbox) reports its own timeout first


def string_argument(arguments: Mapping[str, Any], key: str) -> str:
    """``arguments[key]`` as a string, else `ToolError` (what the model is told)."""
    if not isinstance(arguments, Mapping) or not isinstance(arguments.get(key), str):
        raise ToolError(f'expected arguments {{"{key}": "<text>"}}, got {arguments!r}')
    return arguments[key]


def call_tool(tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> Observation:
    """``tool.call(arguments)`` in a daemon thread, waited for at most ``timeout_s`` (plus
    `GRACE_S`). Any exception becomes an error observation. A Python thread cannot be killed:
    a tool that overruns is abandoned, still running, and its result discarded — tools that
    can hang (user code) should enforce their own limit, as the sandboxed ``python`` does."""
    out: queue.Queue[tuple[bool, str]] = queue.Queue(maxsize=1)

    def work() -> None:
        try:
            out.put((True, str(tool.call(arguments))))
        except (BudgetExceeded, Interrupted) as exc:  # not a tool's doing; reported, as any error
            out.put((False, f"Error: {exc}"))
        except ToolError as exc:
            out.put((False, f"Error: {exc}"))
        except Exception as exc:  # a tool's bug is the model's observation, not our crash
            out.put((False, f"Error: {type(exc).__name__}: {exc}"))

    start = time.perf_counter()
    threading.Thread(target=work, name=f"tool-{tool.name}", daemon=True).start()
    try:
        ok, text = out.get(timeout=timeout_s + GRACE_S)
    except queue.Empty:
        ok, text = False, f"Error: the {tool.name} tool timed out after {timeout_s:g} s"
    return Observation(text, ok, time.perf_counter() - start)
