"""`SamplingParams`: one request's decoding parameters, validated on construction.

Validation raises `InvalidParameter` naming the parameter, the value and what is allowed; it
never clamps. ``temperature == 0`` means greedy (argmax of the processed logits), as in the
OpenAI API. Field names follow vLLM / llama.cpp / transformers where they exist, so
`from_openai` accepts request bodies written for those servers. Where each adapter sits in
the logits pipeline is documented in `metaloom.sampling.pipeline`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from metaloom.errors import InvalidParameter

DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's and text-generation-webui's default


def _finite(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameter(name, value, "a finite number")


def _integer(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameter(name, value, "an integer")


def _in_range(name: str, value: Any, lo: float, hi: float, allowed: str, *, lo_open: bool = False,
              hi_open: bool = False) -> None:
    _finite(name, value)
    if value < lo or (lo_open and value == lo) or value > hi or (hi_open and value == hi):
        raise InvalidParameter(name, value, allowed)


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
    include_stop_str_in_output: bool = False  # keep a matched stop string in the text (vLLM's name)
    top_logprobs: int = 0  # also report the k most likely tokens at each position (OpenAI's name); 0: none
    # dynamic temperature (llama.cpp dynatemp): temperature in [t - range, t + range] by entropy
    dynatemp_range: float = 0.0  # 0 disables
    dynatemp_exponent: float = 1.0
    typical_p: float = 1.0  # locally typical sampling (Meister et al. 2023); 1 disables
    epsilon_cutoff: float = 0.0  # epsilon sampling (Hewitt et al. 2022); 0 disables
    eta_cutoff: float = 0.0  # eta sampling (Hewitt et al. 2022); 0 disables
    top_h: float = 0.0  # entropy-bounded truncation (Potraghloo et al. 2025); 0 disables
    top_n_sigma: float = 0.0  # top-nσ (Tang et al. 2024); 0 disables
    xtc_probability: float = 0.0  # exclude top choices; 0 disables
    xtc_threshold: float = 0.1
    mirostat: int = 0  # 0 off, 2 = mirostat v2 (Basu et al. 2021)
    mirostat_tau: float = 5.0  # target surprise, bits
    mirostat_eta: float = 0.1  # learning rate of mu
    dry_multiplier: float = 0.0  # DRY "don't repeat yourself"; 0 disables
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1 = whole history (prompt and output)
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    no_repeat_ngram_size: int = 0  # 0 disables

    def __post_init__(self) -> None:
        self._check_basics()
        self._check_adapters()

    def _check_basics(self) -> None:
        _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidParameter("temperature", self.temperature, ">= 0 (0 means greedy)")
        _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidParameter("top_k", self.top_k, ">= 0 (0 disables)")
        _in_range("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", lo_open=True)
        _in_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidParameter("repetition_penalty", self.repetition_penalty, "> 0 (1 disables)")
        for name in ("presence_penalty", "frequency_penalty"):
            _in_range(name, getattr(self, name), -2.0, 2.0, "in [-2, 2]")
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
            if not -(2**63) <= self.seed < 2**63:  # what a torch.Generator takes
                raise InvalidParameter("seed", self.seed, "an integer in the int64 range [-2^63, 2^63)")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", self.stop, "a tuple of non-empty strings")
        _integer("top_logprobs", self.top_logprobs)
        if self.top_logprobs < 0:
            raise InvalidParameter("top_logprobs", self.top_logprobs, ">= 0 (0: the chosen token's log-probability only)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, getattr(self, name), "True or False")

    def _check_adapters(self) -> None:
        _finite("dynatemp_range", self.dynatemp_range)
        if not 0.0 <= self.dynatemp_range <= self.temperature:
            raise InvalidParameter("dynatemp_range", self.dynatemp_range,
                                   f"in [0, temperature={self.temperature}] so the lowest temperature is not negative")
        _in_range("dynatemp_exponent", self.dynatemp_exponent, 0.0, math.inf, "> 0", lo_open=True)
        _in_range("typical_p", self.typical_p, 0.0, 1.0, "in (0, 1] (1 disables)", lo_open=True)
        _in_range("epsilon_cutoff", self.epsilon_cutoff, 0.0, 1.0, "in [0, 1) (0 disables)", hi_open=True)
        _in_range("eta_cutoff", self.eta_cutoff, 0.0, 1.0, "in [0, 1) (0 disables)", hi_open=True)
        _in_range("top_h", self.top_h, 0.0, 1.0, "in [0, 1] (0 disables)")
        _in_range("top_n_sigma", self.top_n_sigma, 0.0, math.inf, ">= 0 (0 disables)")
        _in_range("xtc_probability", self.xtc_probability, 0.0, 1.0, "in [0, 1] (0 disables)")
        _in_range("xtc_threshold", self.xtc_threshold, 0.0, 0.5, "in (0, 0.5] (above 0.5 no two tokens can pass it)",
                  lo_open=True)
        _integer("mirostat", self.mirostat)
        if self.mirostat not in (0, 2):
            raise InvalidParameter("mirostat", self.mirostat, "0 (off) or 2 (mirostat v2; v1 is not implemented)")
        _in_range("mirostat_tau", self.mirostat_tau, 0.0, math.inf, "> 0 (bits)", lo_open=True)
        _in_range("mirostat_eta", self.mirostat_eta, 0.0, math.inf, ">= 0")
        _in_range("dry_multiplier", self.dry_multiplier, 0.0, math.inf, ">= 0 (0 disables)")
        _in_range("dry_base", self.dry_base, 1.0, math.inf, ">= 1")
        _integer("dry_allowed_length", self.dry_allowed_length)
        if self.dry_allowed_length < 1:
            raise InvalidParameter("dry_allowed_length", self.dry_allowed_length, ">= 1")
        _integer("dry_penalty_last_n", self.dry_penalty_last_n)
        if self.dry_penalty_last_n != -1 and self.dry_penalty_last_n < 1:
            raise InvalidParameter("dry_penalty_last_n", self.dry_penalty_last_n, "-1 (whole history) or >= 1")
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str) or not all(isinstance(s, str) and s for s in breakers):
            raise InvalidParameter("dry_sequence_breakers", breakers, "a tuple of non-empty strings")
        _integer("no_repeat_ngram_size", self.no_repeat_ngram_size)
        if self.no_repeat_ngram_size < 0:
            raise InvalidParameter("no_repeat_ngram_size", self.no_repeat_ngram_size, ">= 0 (0 disables)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adapters(self) -> frozenset[str]:
        """Names of the pipeline steps that act on this row. Greedy rows skip temperature and
        everything after it, so only penalties and bias count for them."""
        on = {
            "repetition": self.repetition_penalty != 1.0,
            "presence_frequency": self.presence_penalty != 0.0 or self.frequency_penalty != 0.0,
            "dry": self.dry_multiplier > 0.0,
            "no_repeat_ngram": self.no_repeat_ngram_size > 0,
            "logit_bias": bool(self.logit_bias),
        }
        if not self.greedy:
            on.update({
                "dynatemp": self.dynatemp_range > 0.0,
                "top_n_sigma": self.top_n_sigma > 0.0,
                "top_k": self.top_k > 0,
                "top_p": self.top_p < 1.0,
                "min_p": self.min_p > 0.0,
                "typical": self.typical_p < 1.0,
                "epsilon": self.epsilon_cutoff > 0.0,
                "eta": self.eta_cutoff > 0.0,
                "top_h": self.top_h > 0.0,
                "xtc": self.xtc_probability > 0.0,
                "mirostat": self.mirostat == 2,
            })
        return frozenset(name for name, used in on.items() if used)

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: logit-bias ids must be in the vocabulary."""
        if self.top_logprobs > vocab_size:
            raise InvalidParameter("top_logprobs", self.top_logprobs, f"at most the vocab size {vocab_size}")
        for token in self.logit_bias:
            if token >= vocab_size:
                raise InvalidParameter("logit_bias", token, f"token ids < vocab size {vocab_size}")

    @classmethod
    def from_openai(cls, body: Mapping[str, Any]) -> SamplingParams:
        """Build from an OpenAI (chat) completions request body; unknown keys are ignored
        here because they belong to the request, not to sampling. Extensions use the names
        vLLM, llama.cpp's server and transformers use (``top_k``, ``min_p``, ``typical_p``,
        ``mirostat_tau``, ``dry_multiplier``, ``xtc_probability``, ``no_repeat_ngram_size`` ...)."""
        kwargs: dict[str, Any] = {}
        for key in _OPENAI_SCALARS:
            if body.get(key) is not None:
                kwargs[key] = body[key]
        both = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
        if None not in both and both[0] != both[1]:  # one would be dropped in silence
            raise InvalidParameter("max_completion_tokens", both[1],
                                   f"not set beside a different max_tokens ({both[0]}): one of them")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        for key in ("stop", "dry_sequence_breakers"):
            value = body.get(key)
            if value is not None:
                kwargs[key] = (value,) if isinstance(value, str) else tuple(value)
        bias = body.get("logit_bias")
        if bias is not None:
            try:
                kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
            except (TypeError, ValueError, AttributeError) as exc:
                raise InvalidParameter("logit_bias", bias, "a map from token id to number") from exc
            for token, value in kwargs["logit_bias"].items():  # OpenAI's range (the CLI takes any finite bias)
                if not -100 <= value <= 100:
                    raise InvalidParameter(f"logit_bias[{token}]", value, "a bias in [-100, 100]")
        return cls(**kwargs)


# every scalar field is taken from a request body under its own name
_OPENAI_SCALARS = tuple(f.name for f in fields(SamplingParams)
                        if f.name not in ("logit_bias", "max_tokens", "stop", "dry_sequence_breakers"))
