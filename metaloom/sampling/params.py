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
from metaloom.sampling.knobs import at_least, finite, in_range, integer, knob, knobs, one_of, strings

DRY_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's and text-generation-webui's default
INF = math.inf


def _dynatemp_range(name: str, value: Any, params: Any) -> None:
    finite(name, value)
    if not 0.0 <= value <= params.temperature:
        raise InvalidParameter(name, value, f"in [0, temperature={params.temperature}] so the lowest temperature is "
                                            "not negative")


def _last_n(name: str, value: Any, _: Any) -> None:
    integer(name, value)
    if value != -1 and value < 1:
        raise InvalidParameter(name, value, "-1 (whole history) or >= 1")


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters. Each sampler parameter is declared once, as a `knob`
    (`metaloom.sampling.knobs`): its field, the pipeline step that reads it, its validation, its
    CLI flag and the value a remote server is probed with. The rest are the request's own
    (length, samples, seed, stop strings, log-probabilities)."""

    temperature: float = knob(1.0, adapter=None, switch=False, check=in_range(0.0, INF, ">= 0 (0 means greedy)"),
                              help="0 = greedy")
    top_k: int = knob(0, adapter="top_k", check=at_least(0, ">= 0 (0 disables)"), probe=2,
                      help="keep the k most likely tokens (0 = off)")
    top_p: float = knob(1.0, adapter="top_p", check=in_range(0.0, 1.0, "in (0, 1]", lo_open=True),
                        help="nucleus: smallest set with this much probability (1 = off)")
    min_p: float = knob(0.0, adapter="min_p", check=in_range(0.0, 1.0, "in [0, 1]"), probe=0.05,
                        help="drop tokens below min_p times the top probability (0 = off)")
    # CTRL-style, over prompt and output (1 disables)
    repetition_penalty: float = knob(1.0, adapter="repetition", greedy_too=True, probe=1.05,
                                     check=in_range(0.0, INF, "> 0 (1 disables)", lo_open=True),
                                     help="CTRL penalty over prompt and output tokens (1 = off)")
    presence_penalty: float = knob(0.0, adapter="presence_frequency", greedy_too=True,
                                   check=in_range(-2.0, 2.0, "in [-2, 2]"),
                                   help="OpenAI presence penalty over output tokens")
    frequency_penalty: float = knob(0.0, adapter="presence_frequency", greedy_too=True,
                                    check=in_range(-2.0, 2.0, "in [-2, 2]"),
                                    help="OpenAI frequency penalty over output tokens")
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    max_tokens: int = 256
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = field(default=False, metadata={"probe": True})  # keep generating past end-of-sequence (benchmarks)
    # keep a matched stop string in the text (vLLM's name)
    include_stop_str_in_output: bool = field(default=False, metadata={"probe": True})
    top_logprobs: int = 0  # also report the k most likely tokens at each position (OpenAI's name); 0: none
    # dynamic temperature (llama.cpp dynatemp): temperature in [t - range, t + range] by entropy
    dynatemp_range: float = knob(0.0, adapter="dynatemp", check=_dynatemp_range, probe=0.1,
                                 help="dynamic temperature: vary it in [t - range, t + range] by entropy (0 = off)")
    dynatemp_exponent: float = knob(1.0, adapter="dynatemp", switch=False, probe=1.5,
                                    check=in_range(0.0, INF, "> 0", lo_open=True),
                                    help="dynamic temperature: exponent of the normalised entropy")
    # locally typical sampling (Meister et al. 2023)
    typical_p: float = knob(1.0, adapter="typical", check=in_range(0.0, 1.0, "in (0, 1] (1 disables)", lo_open=True),
                            probe=0.95, help="locally typical sampling mass (1 = off)")
    # epsilon and eta sampling (Hewitt et al. 2022)
    epsilon_cutoff: float = knob(0.0, adapter="epsilon", probe=0.0003,
                                 check=in_range(0.0, 1.0, "in [0, 1) (0 disables)", hi_open=True),
                                 help="epsilon sampling: drop tokens below this probability (0 = off)")
    eta_cutoff: float = knob(0.0, adapter="eta", check=in_range(0.0, 1.0, "in [0, 1) (0 disables)", hi_open=True),
                             probe=0.0003, help="eta sampling: entropy-adaptive epsilon (0 = off)")
    # entropy-bounded truncation (Potraghloo et al. 2025)
    top_h: float = knob(0.0, adapter="top_h", check=in_range(0.0, 1.0, "in [0, 1] (0 disables)"), probe=0.9,
                        help="top-H: entropy bound as a fraction of the entropy (0 = off)")
    top_n_sigma: float = knob(0.0, adapter="top_n_sigma", check=in_range(0.0, INF, ">= 0 (0 disables)"), probe=2.0,
                              help="top-nσ: keep logits >= max - n·std (0 = off)")  # Tang et al. 2024
    xtc_probability: float = knob(0.0, adapter="xtc", check=in_range(0.0, 1.0, "in [0, 1] (0 disables)"), probe=0.1,
                                  help="XTC: chance per token of excluding the top choices (0 = off)")
    xtc_threshold: float = knob(0.1, adapter="xtc", switch=False, probe=0.2,
                                check=in_range(0.0, 0.5, "in (0, 0.5] (above 0.5 no two tokens can pass it)",
                                               lo_open=True),
                                help="XTC: probability a token needs to count as a top choice")
    # mirostat v2 (Basu et al. 2021): 0 off, 2 on; the pipeline reads a bool column instead
    mirostat: int = knob(0, adapter="mirostat", column=False, probe=2,
                         check=one_of((0, 2), "0 (off) or 2 (mirostat v2; v1 is not implemented)"),
                         help="2 = mirostat v2 (0 = off)")
    mirostat_tau: float = knob(5.0, adapter="mirostat", switch=False, probe=4.0,
                               check=in_range(0.0, INF, "> 0 (bits)", lo_open=True),
                               help="mirostat: target surprise in bits")
    mirostat_eta: float = knob(0.1, adapter="mirostat", switch=False, probe=0.2, check=in_range(0.0, INF, ">= 0"),
                               help="mirostat: learning rate")
    # DRY "don't repeat yourself"
    dry_multiplier: float = knob(0.0, adapter="dry", greedy_too=True, probe=0.5,
                                 check=in_range(0.0, INF, ">= 0 (0 disables)"),
                                 help="DRY: penalty multiplier for extending a repeated sequence (0 = off)")
    dry_base: float = knob(1.75, adapter="dry", switch=False, greedy_too=True, probe=1.5,
                           check=in_range(1.0, INF, ">= 1"), help="DRY: base of the penalty's growth with the repeat length")
    dry_allowed_length: int = knob(2, adapter="dry", switch=False, greedy_too=True, probe=3,
                                   check=at_least(1, ">= 1"), help="DRY: repeats up to this long are free")
    dry_penalty_last_n: int = knob(-1, adapter="dry", switch=False, greedy_too=True, probe=64, check=_last_n,
                                   help="DRY: tokens of history searched (-1 = all)")
    # the CLI takes these with --dry-sequence-breaker (repeatable) and --no-dry-sequence-breakers
    dry_sequence_breakers: tuple[str, ...] = knob(DRY_BREAKERS, adapter="dry", switch=False, greedy_too=True,
                                                  column=False, check=strings, probe=["\n"], help=None)
    no_repeat_ngram_size: int = knob(0, adapter="no_repeat_ngram", greedy_too=True, probe=3,
                                     check=at_least(0, ">= 0 (0 disables)"),
                                     help="ban any n-gram of this size from repeating (0 = off)")

    def __post_init__(self) -> None:
        self._check_request()
        for f, k in _KNOBS:
            k.check(f.name, getattr(self, f.name), self)

    def _check_request(self) -> None:
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidParameter("logit_bias", token, "token ids that are integers >= 0")
            finite(f"logit_bias[{token}]", bias)
        at_least(1, ">= 1")("max_tokens", self.max_tokens, self)
        at_least(1, ">= 1")("n", self.n, self)
        if self.seed is not None:
            integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:  # what a torch.Generator takes
                raise InvalidParameter("seed", self.seed, "an integer in the int64 range [-2^63, 2^63)")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", self.stop, "a tuple of non-empty strings")
        at_least(0, ">= 0 (0: the chosen token's log-probability only)")("top_logprobs", self.top_logprobs, self)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, getattr(self, name), "True or False")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adapters(self) -> frozenset[str]:
        """Names of the pipeline steps that act on this row: each knob's ``adapter`` whose
        switching parameter is away from its default, and ``logit_bias`` when set. Greedy rows
        skip temperature and everything after it, so only penalties and bias count for them."""
        on = {"logit_bias"} if self.logit_bias else set()
        for f, k in _KNOBS:
            if k.adapter and k.switch and (k.greedy_too or not self.greedy) and getattr(self, f.name) != f.default:
                on.add(k.adapter)
        return frozenset(on)

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


# the declarations, read once; what the other layers read from them below
_KNOBS = tuple(knobs(SamplingParams))
# the CLI's sampler flags: (field, type, help), in field order (`metaloom.commands.common`)
SAMPLER_FLAGS: tuple[tuple[str, type, str], ...] = tuple((f.name, type(f.default), k.help)
                                                         for f, k in _KNOBS if k.help is not None)
# the per-row tensor columns each pipeline step reads (`metaloom.sampling.pipeline`); int fields are long
ADAPTER_COLUMNS: dict[str, tuple[str, ...]] = {}
for _f, _k in _KNOBS:
    if _k.adapter is not None and _k.column:
        ADAPTER_COLUMNS[_k.adapter] = (*ADAPTER_COLUMNS.get(_k.adapter, ()), _f.name)
INTEGER_FIELDS = frozenset(f.name for f in fields(SamplingParams) if type(f.default) is int)
# a valid non-default value of each field a remote server must be asked about
# (`metaloom.generator.remote.detect`); OpenAI's own fields are not probed
PROBES: dict[str, Any] = {f.name: k.probe for f, k in _KNOBS if k.probe is not None}
PROBES.update({f.name: f.metadata["probe"] for f in fields(SamplingParams) if "probe" in f.metadata})
