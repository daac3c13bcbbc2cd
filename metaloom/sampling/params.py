"""`SamplingParams`: one request's decoding parameters, validated on construction.

Validation raises `InvalidParameter` naming the parameter, the value and what is allowed; it
never clamps. ``temperature == 0`` means greedy (argmax of the processed logits), as in the
OpenAI API.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameter(name, value, "a finite number")


def _integer(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameter(name, value, "an integer")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output (1 disables)
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    max_tokens: int = 256
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks)

    def __post_init__(self) -> None:
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameter("temperature", self.temperature, ">= 0 (0 means greedy)")
        _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidParameter("top_k", self.top_k, ">= 0 (0 disables)")
        _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameter("top_p", self.top_p, "in (0, 1]")
        _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameter("min_p", self.min_p, "in [0, 1]")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidParameter("repetition_penalty", self.repetition_penalty, "> 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _finite(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidParameter(name, value, "in [-2, 2]")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidParameter("logit_bias", token, "token ids that are integers >= 0")
            _finite(f"logit_bias[{token}]", bias)
        _integer("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidParameter("max_tokens", self.max_tokens, ">= 1")
        _integer("n", self.n)
        if self.n < 1:
            raise InvalidParameter("n", self.n, ">= 1")
        if self.seed is not None:
            _integer("seed", self.seed)
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", self.stop, "a tuple of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: logit-bias ids must be in the vocabulary."""
        for token in self.logit_bias:
            if token >= vocab_size:
                raise InvalidParameter("logit_bias", token, f"token ids < vocab size {vocab_size}")

    @classmethod
    def from_openai(cls, body: Mapping[str, Any]) -> SamplingParams:
        """Build from an OpenAI (chat) completions request body; unknown keys are ignored
        here because they belong to the request, not to sampling."""
        kwargs: dict[str, Any] = {}
        for key in ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty",
                    "top_k", "min_p", "repetition_penalty", "ignore_eos"):
            if body.get(key) is not None:
                kwargs[key] = body[key]
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        stop = body.get("stop")
        if stop is not None:
            kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        bias = body.get("logit_bias")
        if bias is not None:
            try:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError, AttributeError) as exc:
                raise InvalidParameter("logit_bias", bias, "a map from token id to number") from exc
        return cls(**kwargs)
