"""What goes into and comes out of a `Generator` — the seam meta-strategies, search, the
server and evaluation are written against. A strategy runs unchanged on the local engine, a
remote OpenAI-compatible server, or a script, because it sees only this module.

Nothing here imports torch, a tokenizer or a cache: a remote generator implements the
protocol with HTTP calls, and `import metaloom.meta` stays light.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from metaloom.constrain.spec import ConstraintSpec
from metaloom.decode.specs import DecoderSpec, TopLogprobs
from metaloom.errors import InvalidParameter
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams

if TYPE_CHECKING:
    from metaloom.generator.capabilities import Capabilities

Message = dict[str, str]  # {"role": ..., "content": ...}

# why a completion ended (`Completion.finish_reason`)
FINISH_REASONS = (
    "stop",  # an end-of-sequence token, a stop string, or a complete constrained output
    "length",  # max_tokens reached
    "budget",  # a `Budget` limit was reached mid-generation; the text so far is kept
    "error",  # this row could not go on (e.g. every token was excluded); `Completion.error` says why
    "cancelled",  # the caller stopped it (a closed stream, a disconnected client)
)


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidParameter(name, ids, "a sequence of token ids (integers >= 0)")
    out = tuple(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in out):
        raise InvalidParameter(name, ids, "token ids: integers >= 0")
    return out


@dataclass(frozen=True)
class TokenIds:
    """A prompt given as token ids, used exactly as given (no chat template, no encoding, no
    special tokens added): how a branch of a search restates a prompt without re-encoding
    drift. Ids are checked against the vocabulary by the generator."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", _token_ids("prompt ids", self.ids))
        if not self.ids:
            raise InvalidParameter("prompt ids", self.ids, "at least one token id")


Prompt = str | tuple[Message, ...] | TokenIds



def check_prompt(prompt: object) -> None:
    """Raise `InvalidParameter` unless ``prompt`` is text, chat messages or `TokenIds`."""
    if isinstance(prompt, (str, TokenIds)):
        return
    if not isinstance(prompt, tuple) or not prompt:
        raise InvalidParameter("prompt", prompt, "text, a non-empty tuple of chat messages, or TokenIds")
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidParameter("prompt", m, "a message {'role': str, 'content': str}")


def render(generator: Generator, prompt: Prompt) -> str:
    """The prompt as raw text the model continues — what strategies that insert text into a
    generation (budget forcing's "Wait") send back as a raw prompt. A chat prompt goes through
    the generator's chat template (`Generator.render`)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, TokenIds):
        raise InvalidParameter("prompt", prompt, "text or chat messages (token ids have no text to extend)")
    generator.capabilities.require("render", type(generator).__name__)
    return generator.render(prompt)


@dataclass(frozen=True)
class Request:
    """A prompt and how to generate from it.

    ``prompt``: raw text (plain completion), chat messages (through the model's chat
    template), or `TokenIds` (exact). ``prefix``: token ids of the answer so far — the output
    continues after them exactly, as if the model had just produced them (penalties count them
    as output; a constraint must accept them first). The completion holds only the new tokens.
    This is how a branch continues where its parent stopped: ``Request(prompt,
    prefix=parent.token_ids)``.

    ``constraint``: the whole answer (prefix included) must match it (`metaloom.constrain`);
    ``token_healing``: back the prompt up over its last token and make the output start with
    the removed text (`metaloom.decode.healing`; not with a ``prefix``, which fixes where the
    answer starts). ``decoder``: None for the sampling pipeline (greedy at temperature 0), or a
    beam search / contrastive decoding / classifier-free guidance spec
    (`metaloom.decode.specs`)."""

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: ConstraintSpec | None = None
    token_healing: bool = False
    decoder: DecoderSpec | None = None
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_prompt(self.prompt)
        if not isinstance(self.params, SamplingParams):
            raise InvalidParameter("params", self.params, "a SamplingParams")
        object.__setattr__(self, "prefix", _token_ids("prefix", self.prefix))
        if self.token_healing and self.prefix:
            raise InvalidParameter("token_healing", True, "False with a prefix (healing rewrites the prompt's end; "
                                   "a prefix fixes where the answer starts)")

    @classmethod
    def chat(cls, user: str, params: SamplingParams | None = None, system: str | None = None) -> Request:
        messages: tuple[Message, ...] = ({"role": "user", "content": user},)
        if system is not None:
            messages = ({"role": "system", "content": system}, *messages)
        return cls(messages, params or SamplingParams())


@dataclass(frozen=True)
class Completion:
    """One sample: the new text and tokens (after the request's ``prefix``, if any).

    ``logprobs[i]`` is the model's log-probability of ``token_ids[i]`` under the raw model
    distribution (before the sampling pipeline — and, for contrastive decoding or guidance,
    the expert's / conditional stream's), so ``logprob`` is the sequence log-likelihood
    whatever drew it. ``decoder_logprobs[i]``, when given, is the log-probability of the token
    under the distribution it was actually drawn from (after penalties, temperature,
    truncation, and the contrastive or guidance combination).

    ``finish_reason`` is one of `FINISH_REASONS`. ``stop_reason`` says what stopped a "stop":
    the stop string that matched (str), the end-of-sequence token id (int), or None when a
    constraint completed. A matched stop string is cut from ``text`` unless the request set
    ``include_stop_str_in_output``; the token that completed it is always in ``token_ids``.
    ``error`` explains an "error" finish. ``score``: the decoder's ranking score, if it has one
    (beam search: the length-penalised sum). ``top_logprobs[i]``, when the request set
    ``params.top_logprobs = k``: the k most likely tokens at position i under the same raw
    distribution as ``logprobs``, as (token id, log-probability) pairs, most likely first."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    stop_reason: str | int | None = None
    score: float | None = None
    decoder_logprobs: tuple[float, ...] | None = None
    error: str | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass(frozen=True)
class StreamChunk:
    """A piece of sample ``index`` of a streamed request: its new text, the tokens behind it
    and their raw log-probabilities; the last chunk of a sample carries its finish (and stop
    reason, and error). Text may lag tokens: text that could still become a stop string, or an
    incomplete character, is held back until it is settled."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    index: int = 0
    error: str | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, as `Completion.top_logprobs`


@dataclass(frozen=True)
class Scored:
    """A continuation as `Generator.score` saw it: ``logprobs[j]`` = log p(token_ids[j] |
    prompt, token_ids[:j]) under the raw model."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def mean_logprob(self) -> float:
        return self.logprob / len(self.logprobs) if self.logprobs else float("nan")


@runtime_checkable
class Generator(Protocol):
    """What every generator offers: the local engine, a remote server, a scripted table.

    Every method charges what it spends to ``ledger``. A request that uses something
    `capabilities` lacks raises `metaloom.errors.Unsupported` before any compute."""

    @property
    def capabilities(self) -> Capabilities:
        """Which sampling parameters, decoders, constraints and features this generator serves."""
        ...

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        """One list of ``params.n`` completions per request, in request order. A budget reached
        mid-generation ends the affected samples with finish "budget" (the text so far kept)."""
        ...

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        """Chunks of the ``params.n`` samples of ``request`` as they are produced (interleaved;
        `StreamChunk.index` says whose). Closing the iterator cancels what is left."""
        ...

    def score(self, prompt: Prompt, continuations: Sequence[str | TokenIds], *, ledger: Ledger) -> list[Scored]:
        """Per-token log-probabilities of each continuation after ``prompt`` (a chat prompt is
        rendered with the generation prompt, so a continuation is the assistant's answer), in
        one batched call."""
        ...

    def render(self, messages: Sequence[Message]) -> str:
        """The chat template applied to ``messages`` (with the generation prompt) as text, for
        strategies that continue raw text."""
        ...
