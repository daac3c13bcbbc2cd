"""What one request may ask of the server: every dimension a request can multiply is bounded.

One request must never take the server down. A plain request multiplies its rows (``n`` times
the prompts of a completions batch) by ``max_tokens``; beam search by its ``beams``; a strategy
by its widths (samples, beams, particles, children per node) and depths (rounds, steps, tree
depth), and nests strategies inside strategies. Each of those is a server setting with a
documented default (`Limits`, `metaloom serve --help`, ``GET /v1/limits``), and a request over
one is a 400 naming the field and the limit, before any work. What a strategy finally spends is
bounded as well: it runs under a budget of ``max_request_tokens`` generated tokens and
``max_request_seconds`` (a tighter budget of the request's own still applies), so a strategy
whose parameters each pass cannot multiply them past what the server allows.

The KV memory a request will hold is checked separately, against the pool
(`metaloom.server.admission`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.ledger import Budget

# prompt tokens the scheduler admits between two decode steps at most (a longer request goes alone):
# about a second of prefill for a 135M model on two cores, so running streams are not held for a burst
MAX_PREFILL_TOKENS = 2048


def check_sizes(max_rows: int, max_waiting: int, max_prefill_tokens: int) -> None:
    """The scheduler's sizes (`metaloom serve` checks them before loading a model), refused with
    `InvalidParameter` naming the one out of range."""
    if max_rows < 1:
        raise InvalidParameter("max_rows", max_rows, ">= 1")
    if max_waiting < 0:
        raise InvalidParameter("max_waiting", max_waiting, ">= 0")
    if max_prefill_tokens < 1:
        raise InvalidParameter("max_prefill_tokens", max_prefill_tokens, ">= 1 token")


# routes a client may call without the API key (``--open-routes``): "docs" is /docs, /redoc and /openapi.json
OPEN_ROUTES = ("health", "metrics", "docs")

# A strategy's integer parameters by what they multiply. Every integer parameter of every
# registered strategy is in one of these (tests/test_server_limits.py holds it), so a new
# parameter cannot slip past the limits unclassified.
WIDTHS = frozenset({"n", "beam_width", "k", "parallel", "initial", "width", "batch", "max_samples", "min_samples",
                    "solutions", "min_keep"})
DEPTHS = frozenset({"max_depth", "rounds", "max_steps", "iterations", "max_rounds", "depth", "max_waits", "lookahead"})
TOKENS = frozenset({"max_tokens", "step_tokens", "chunk_tokens", "max_thinking_tokens", "min_thinking_tokens",
                    "answer_max_tokens"})
# bounded by what they read, not multiplied by the request: search results of a local corpus,
# characters of a tool's output kept in the prompt (itself bounded by the context window)
HARMLESS = frozenset({"top_k", "max_observation_chars"})


@dataclass(frozen=True)
class Limits:
    """The server's per-request limits (``metaloom serve --max-*``).

    ``max_n``: rows of one plain request (``n`` times its prompts); ``max_beams``: beam search's
    beams; ``max_samples`` / ``max_depth``: a strategy's widths and depths (`WIDTHS`, `DEPTHS`);
    ``max_request_tokens``: tokens one request may generate in all (``n × max_tokens`` of a
    plain request; the output budget a strategy runs under); ``max_request_seconds``: a
    strategy's run time; ``max_stop``: stop strings; ``max_tools``: functions offered;
    ``max_prompt_tokens``: a prompt's tokens (None: the model's context window)."""

    max_n: int = 128
    max_beams: int = 16
    max_samples: int = 128
    max_depth: int = 64
    max_request_tokens: int = 262_144
    max_request_seconds: float = 900.0
    max_stop: int = 16
    max_tools: int = 128
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
                raise InvalidParameter(f.name, value, "a number >= 1")

    def report(self, context: int) -> dict[str, Any]:
        """The limits as ``GET /v1/limits`` shows them (the prompt limit resolved to ``context``)."""
        out = dataclasses.asdict(self)
        out["max_prompt_tokens"] = self.prompt_tokens(context)
        return out

    def prompt_tokens(self, context: int) -> int:
        """The longest prompt served: the setting, at most the context window less one token."""
        window = context - 1
        return window if self.max_prompt_tokens is None else min(self.max_prompt_tokens, window)

    # --- plain requests ---------------------------------------------------------------------------
    def check_rows(self, n: int, prompts: int) -> None:
        rows = n * prompts
        if rows > self.max_n:
            name = "n" if prompts == 1 else "prompt"
            raise InvalidParameter(name, n if prompts == 1 else f"{prompts} prompts x n={n}",
                                   f"at most {self.max_n} samples per request (server limit max_n)")

    def check_tokens(self, rows: int, max_tokens: int) -> None:
        if rows * max_tokens > self.max_request_tokens:
            raise InvalidParameter("max_tokens", max_tokens, f"at most {self.max_request_tokens // rows} with {rows} "
                                   f"sample(s): {self.max_request_tokens} generated tokens per request "
                                   "(server limit max_request_tokens)")

    def default_tokens(self, rows: int, room: int) -> int:
        """``max_tokens`` for a request that sets none: the room left in the context window, at
        most the request's share of ``max_request_tokens``."""
        return max(1, min(room, self.max_request_tokens // max(rows, 1)))

    def check_stop(self, stop: Sequence[str]) -> None:
        if len(stop) > self.max_stop:
            raise InvalidParameter("stop", f"{len(stop)} strings", f"at most {self.max_stop} (server limit max_stop)")

    def check_tools(self, tools: Any) -> None:
        if isinstance(tools, list) and len(tools) > self.max_tools:
            raise InvalidParameter("tools", f"{len(tools)} functions", f"at most {self.max_tools} (server limit max_tools)")

    def check_beams(self, beams: int) -> None:
        if beams > self.max_beams:
            raise InvalidParameter("beams", beams, f"at most {self.max_beams} (server limit max_beams)")

    # --- strategies -------------------------------------------------------------------------------
    def check_component(self, label: str, values: Mapping[str, Any], context: int, origin: str = "metaloom.params") -> None:
        """One strategy (or component) of a request, its parameters converted to their types;
        ``label`` names it as the request does (``strategy``, ``inner``, ...); ``origin``: where
        the request set them (``metaloom.params``, or ``model`` for an alias)."""
        where = origin if label == "strategy" else f"{origin}.{label}"
        bounds = [(WIDTHS, self.max_samples, "max_samples"), (DEPTHS, self.max_depth, "max_depth"),
                  (TOKENS, context, "the context window")]
        for key, value in values.items():
            for names, bound, setting in bounds:
                if key not in names:
                    continue
                for v in value if isinstance(value, tuple) else (value,):
                    if isinstance(v, int) and not isinstance(v, bool) and v > bound:
                        limit = f"server limit {setting}" if names is not TOKENS else setting
                        raise InvalidParameter(f"{where}.{key}", v, f"at most {bound} ({limit})")

    def strategy_budget(self, asked: Budget | None) -> Budget:
        """The budget a strategy runs under: the request's own, within the server's caps (a
        request that asks for more than a cap is refused, naming the field)."""
        tokens, seconds = self.max_request_tokens, self.max_request_seconds
        if asked is None:
            return Budget(output_tokens=tokens, seconds=seconds)
        if asked.output_tokens is not None and asked.output_tokens > tokens:
            raise InvalidParameter("metaloom.budget.output_tokens", asked.output_tokens,
                                   f"at most {tokens} (server limit max_request_tokens)")
        if asked.seconds is not None and asked.seconds > seconds:
            raise InvalidParameter("metaloom.budget.seconds", asked.seconds,
                                   f"at most {seconds:g} (server limit max_request_seconds)")
        return dataclasses.replace(asked, output_tokens=asked.output_tokens if asked.output_tokens is not None else tokens,
                                   seconds=asked.seconds if asked.seconds is not None else seconds)
