"""What a generator can serve, and the check that turns a request asking for more into a typed
`Unsupported` error before any compute (never a silently ignored field).

A remote server fills these sets from what it detected at start-up; the local engine from
what it has (an amateur model for contrastive decoding, a grammar engine for constraints).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from metaloom.constrain.spec import KINDS as CONSTRAINT_KINDS
from metaloom.decode.specs import DECODER_NAMES
from metaloom.errors import Unsupported
from metaloom.generator.types import Request, TokenIds
from metaloom.sampling.params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_DEFAULTS = SamplingParams()

FEATURES = frozenset({
    "token_ids",  # completions carry the generated token ids
    "logprobs",  # completions carry per-token raw log-probabilities
    "score",  # Generator.score
    "render",  # Generator.render (chat template as text)
    "stream",  # Generator.stream with real incremental chunks
    "token_prompts",  # Request.prompt as TokenIds
    "prefix",  # Request.prefix: exact continuation from token ids
    "token_healing",  # Request.token_healing
})


@dataclass(frozen=True)
class Capabilities:
    """``sampling``: the `SamplingParams` fields honoured (a field left at its default is
    always fine); ``decoders``: names of the decoder specs served ("beam", "contrastive",
    "cfg"); ``constraints``: constraint kinds ("json_schema", "regex", "lark", "choices");
    ``features``: names from `FEATURES`; ``max_n``: most samples per request (None: no limit)."""

    sampling: frozenset[str] = SAMPLING_FIELDS
    decoders: frozenset[str] = frozenset()
    constraints: frozenset[str] = frozenset(CONSTRAINT_KINDS)
    features: frozenset[str] = FEATURES
    max_n: int | None = None

    def require(self, feature: str, who: str, detail: str = "") -> None:
        """Raise `Unsupported` unless ``feature`` is served."""
        if feature not in self.features:
            raise Unsupported(feature, who, detail)

    def check(self, request: Request, who: str) -> None:
        """Raise `Unsupported` naming the first part of ``request`` this generator cannot serve."""
        p = request.params
        for name in sorted(SAMPLING_FIELDS - self.sampling):
            if getattr(p, name) != getattr(_DEFAULTS, name):
                raise Unsupported(f"params.{name}", who, f"set to {getattr(p, name)!r}")
        if self.max_n is not None and p.n > self.max_n:
            raise Unsupported("params.n", who, f"{p.n} samples; at most {self.max_n} per request")
        if request.decoder is not None:
            name = DECODER_NAMES.get(type(request.decoder), type(request.decoder).__name__)
            if name not in self.decoders:
                raise Unsupported(f"decoder {name}", who, f"decoders served: {sorted(self.decoders) or 'none'}")
        if request.constraint is not None and request.constraint.kind not in self.constraints:
            raise Unsupported(f"constraint {request.constraint.kind}", who,
                              f"constraints served: {sorted(self.constraints) or 'none'}")
        if request.token_healing:
            self.require("token_healing", who)
        if isinstance(request.prompt, TokenIds):
            self.require("token_prompts", who)
        if request.prefix:
            self.require("prefix", who)
