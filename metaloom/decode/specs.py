"""What a request may ask of a decoder other than the sampling pipeline, and the shape of the
top log-probabilities a decoder records, as plain data.

These specs travel in `metaloom.generator.types.Request.decoder`; they import no torch, so
strategies, the server and remote generators can build and validate them. The local engine
runs them (`metaloom.decode.beam`, `metaloom.decode.contrastive`); a remote generator that
cannot refuses them with `metaloom.errors.Unsupported`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.sampling.params import SamplingParams

TopLogprobs = tuple[tuple[int, float], ...]  # one position's most likely tokens: (token id, log-probability)


@dataclass(frozen=True)
class BeamParams:
    """Beam search configuration; validated on construction (raises, never clamps)."""

    beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("beams", "num_beam_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameter(name, value, "an integer >= 1")
        if self.beams % self.num_beam_groups:
            raise InvalidParameter("num_beam_groups", self.num_beam_groups, f"a divisor of beams={self.beams}")
        for name in ("length_penalty", "diversity_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise InvalidParameter(name, value, "a finite number")
        if self.diversity_penalty < 0:
            raise InvalidParameter("diversity_penalty", self.diversity_penalty, ">= 0")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise InvalidParameter("early_stopping", self.early_stopping, "True, False or 'never'")

    @property
    def group_size(self) -> int:
        return self.beams // self.num_beam_groups

    def check_sampling(self, params: SamplingParams) -> None:
        """Beam search is deterministic: sampling-only settings would be silently ignored, so
        they are errors. (Temperature 1 and 0 leave the log-probabilities unchanged.)"""
        if params.temperature not in (0.0, 1.0):
            raise InvalidParameter("temperature", params.temperature, "0 or 1 with beam search (beams rank log-probabilities)")
        sampled, greedy = dataclasses.replace(params, temperature=1.0), dataclasses.replace(params, temperature=0.0)
        sampling_only = sampled.adapters - greedy.adapters
        if sampling_only:
            raise InvalidParameter("sampling adapters", sorted(sampling_only),
                                   "none with beam search (only penalties, logit bias and constraints shape beam scores)")
        if params.n > self.beams:
            raise InvalidParameter("n", params.n, f"<= beams ({self.beams}): beam search returns its n best hypotheses")



def _finite(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameter(name, value, "a finite number")
    return float(value)


@dataclass(frozen=True)
class ContrastiveParams:
    """``alpha``: plausibility cut in [0, 1] (0 keeps every token; Li et al. use 0.1);
    ``amateur_temperature``: tau > 0 applied to the amateur's logits."""

    alpha: float = 0.1
    amateur_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= _finite("alpha", self.alpha) <= 1.0:
            raise InvalidParameter("alpha", self.alpha, "in [0, 1]")
        if _finite("amateur_temperature", self.amateur_temperature) <= 0:
            raise InvalidParameter("amateur_temperature", self.amateur_temperature, "> 0")

    def row(self) -> tuple[float, ...]:
        return (self.alpha, self.amateur_temperature)


@dataclass(frozen=True)
class GuidanceParams:
    """``scale``: guidance strength gamma >= 0 (1 = conditional, 0 = unconditional; Sanchez et
    al. use 1.5); ``negative_prompt``: the unconditional stream's prompt, encoded like the
    request's prompt (text, or chat messages); None: the prompt's last token alone."""

    scale: float = 1.5
    negative_prompt: str | tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if _finite("cfg_scale", self.scale) < 0:
            raise InvalidParameter("cfg_scale", self.scale, ">= 0")
        if self.negative_prompt is not None and not self.negative_prompt:
            raise InvalidParameter("negative_prompt", self.negative_prompt, "non-empty text or messages, or None")

    def row(self) -> tuple[float, ...]:
        return (self.scale,)


DecoderSpec = BeamParams | ContrastiveParams | GuidanceParams

# the name each spec goes by in `Capabilities.decoders` (and on the command line)
DECODER_NAMES: dict[type, str] = {BeamParams: "beam", ContrastiveParams: "contrastive", GuidanceParams: "cfg"}


# --- names (CLI, server) ----------------------------------------------------------------------

@dataclass(frozen=True)
class DecoderOptions:
    """Every decoder's options, as the CLI and server collect them; each decoder reads its own.
    The defaults are the specs' own (one place to change them)."""

    beams: int = BeamParams.beams
    length_penalty: float = BeamParams.length_penalty
    early_stopping: bool | str = BeamParams.early_stopping
    num_beam_groups: int = BeamParams.num_beam_groups
    diversity_penalty: float = BeamParams.diversity_penalty
    contrastive_alpha: float = ContrastiveParams.alpha
    amateur_temperature: float = ContrastiveParams.amateur_temperature
    cfg_scale: float = GuidanceParams.scale
    negative_prompt: str | tuple[dict[str, str], ...] | None = None


Build = Callable[[SamplingParams, DecoderOptions], tuple[SamplingParams, DecoderSpec | None]]

# the edge where a decoder's name (``--decoder``, a server field) meets its spec
DECODERS: dict[str, Build] = {
    "sample": lambda p, o: (p, None),
    "greedy": lambda p, o: (dataclasses.replace(p, temperature=0.0), None),
    "beam": lambda p, o: (p, BeamParams(beams=o.beams, length_penalty=o.length_penalty, early_stopping=o.early_stopping,
                                        num_beam_groups=o.num_beam_groups, diversity_penalty=o.diversity_penalty)),
    "contrastive": lambda p, o: (p, ContrastiveParams(alpha=o.contrastive_alpha, amateur_temperature=o.amateur_temperature)),
    "cfg": lambda p, o: (p, GuidanceParams(scale=o.cfg_scale, negative_prompt=o.negative_prompt)),
}


def build_decoder(name: str, params: SamplingParams, options: DecoderOptions) -> tuple[SamplingParams, DecoderSpec | None]:
    """(params, decoder spec) for the decoder called ``name``; raises for an unknown name."""
    build = DECODERS.get(name)
    if build is None:
        raise InvalidParameter("decoder", name, f"one of {sorted(DECODERS)}")
    return build(params, options)
