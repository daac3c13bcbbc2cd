"""What goes into and comes out of a `Generator` — the seam meta-strategies are written
against (a strategy runs unchanged on the local engine, a remote server, or a script)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from metaloom.constrain.spec import ConstraintSpec
from metaloom.decode.beam import BeamParams
from metaloom.decode.contrastive import ContrastiveParams, GuidanceParams
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass(frozen=True)
class Request:
    """A prompt and how to sample from it. A ``str`` prompt is raw text (plain completion);
    a sequence of messages goes through the model's chat template.

    ``constraint``: the output must match it (`metaloom.constrain`); ``token_healing``: back
    the prompt up over its last token and make the output start with the removed text
    (`metaloom.decode.healing`; the completion's text then starts with that text)."""

    prompt: str | tuple[Message, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: ConstraintSpec | None = None
    token_healing: bool = False
    # how tokens are chosen (`metaloom.generator.decoders`): None = the sampling pipeline
    # (greedy at temperature 0); beam search, contrastive decoding or classifier-free guidance
    decoder: BeamParams | ContrastiveParams | GuidanceParams | None = None

    @classmethod
    def chat(cls, user: str, params: SamplingParams | None = None, system: str | None = None) -> Request:
        messages: tuple[Message, ...] = ({"role": "user", "content": user},)
        if system is not None:
            messages = ({"role": "system", "content": system}, *messages)
        return cls(messages, params or SamplingParams())


@dataclass(frozen=True)
class Completion:
    """One sample. ``logprobs[i]`` is the model's log-probability of ``token_ids[i]`` (raw
    model distribution, before the sampling pipeline), so ``logprob`` is the sequence
    log-likelihood whatever temperature drew it. ``finish_reason``: "stop" (end-of-sequence
    token or stop string) or "length"."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    score: float | None = None  # the decoder's ranking score, if it has one (beam: length-penalised)

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed completion: new text, the tokens behind it, and the finish reason
    on the last chunk."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


@runtime_checkable
class Generator(Protocol):
    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        """One list of ``params.n`` completions per request, in request order."""
        ...

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        """Chunks of the single completion of ``request`` (``n`` must be 1)."""
        ...
