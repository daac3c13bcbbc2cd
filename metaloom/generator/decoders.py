"""Decoders of the local engine, and the registry that names them at the edges.

`DECODERS` maps the name a user gives (``--decoder``, a server field) to a function that turns
sampling parameters and `DecoderOptions` into what a `Request` carries: its `SamplingParams`
and its ``decoder`` spec (None, `BeamParams`, `ContrastiveParams`, `GuidanceParams`).

`RUNNERS` maps a spec's type to how `LocalGenerator` runs it: token-by-token decoders go
through the one decode loop (contrastive decoding and guidance by prefilling a `LockstepPair`
instead of the bare model); beam search runs `beam_search`. `LocalGenerator.generate` groups
requests by decoder type, runs each group batched, and returns results in request order.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from metaloom.decode.beam import BeamParams, beam_search
from metaloom.decode.contrastive import (
    ContrastiveParams,
    GuidanceParams,
    contrastive_scores,
    guidance_scores,
    prefill_pair,
)
from metaloom.decode.healing import prepare
from metaloom.decode.rows import RowState
from metaloom.errors import ContextWindowExceeded, InvalidParameter
from metaloom.generator.types import Completion, Request, StreamChunk
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.sampling.params import SamplingParams
from metaloom.sampling.pipeline import make_sampler

if TYPE_CHECKING:
    from metaloom.generator.local import LocalGenerator

DecoderSpec = BeamParams | ContrastiveParams | GuidanceParams
# (engine, requests, encoded prompts, cache capacity, ledger) -> (model to decode with, its cache, logits [B, V])
Start = Callable[["LocalGenerator", Sequence[Request], list[list[int]], int, Ledger],
                 tuple[LanguageModel, KVCache, torch.Tensor]]


# --- names (CLI, server) ----------------------------------------------------------------------

@dataclass(frozen=True)
class DecoderOptions:
    """Every decoder's options, as the CLI and server collect them; each decoder reads its own."""

    beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    contrastive_alpha: float = 0.1
    amateur_temperature: float = 1.0
    cfg_scale: float = 1.5
    negative_prompt: str | tuple[dict[str, str], ...] | None = None


Build = Callable[[SamplingParams, DecoderOptions], tuple[SamplingParams, DecoderSpec | None]]

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


# --- running (local engine) -------------------------------------------------------------------

class Runner(Protocol):
    def generate(self, engine: LocalGenerator, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]: ...

    def stream(self, engine: LocalGenerator, request: Request, ledger: Ledger) -> Iterator[StreamChunk]: ...


@dataclass(frozen=True)
class TokenRunner:
    """Token-by-token decoding through the decode loop; ``start`` prefills what it decodes
    with (None: the engine's model)."""

    start: Start | None = None

    def generate(self, engine: LocalGenerator, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]:
        return engine._generate(requests, ledger, self.start)

    def stream(self, engine: LocalGenerator, request: Request, ledger: Ledger) -> Iterator[StreamChunk]:
        return engine._stream(request, ledger, self.start)


def _start_contrastive(engine: LocalGenerator, requests: Sequence[Request], prompts: list[list[int]], capacity: int,
                       ledger: Ledger) -> tuple[LanguageModel, KVCache, torch.Tensor]:
    amateur = engine.amateur
    if amateur is None:
        raise InvalidParameter("amateur_model", None, "an amateur model for contrastive decoding (LocalGenerator(amateur=...))")
    if capacity > amateur.max_context:
        raise ContextWindowExceeded(capacity, amateur.max_context, "prompt plus max_tokens (amateur model)")
    params = torch.tensor([r.decoder.row() for r in requests if isinstance(r.decoder, ContrastiveParams)])
    pair, cache, logits = prefill_pair(engine.model, amateur, prompts, prompts, (capacity, capacity), params,
                                       contrastive_scores, ledger)
    return pair, cache, logits


def _start_guidance(engine: LocalGenerator, requests: Sequence[Request], prompts: list[list[int]], capacity: int,
                    ledger: Ledger) -> tuple[LanguageModel, KVCache, torch.Tensor]:
    specs = [r.decoder for r in requests if isinstance(r.decoder, GuidanceParams)]
    negatives = [engine.encode_prompt(g.negative_prompt) if g.negative_prompt is not None else p[-1:]
                 for g, p in zip(specs, prompts, strict=True)]
    for n, r in zip(negatives, requests, strict=True):
        if len(n) + r.params.max_tokens > engine.model.max_context:
            raise ContextWindowExceeded(len(n) + r.params.max_tokens, engine.model.max_context, "negative prompt plus max_tokens")
    ledger.charge(input_tokens=sum(len(n) for n in negatives))
    second = max(len(n) + r.params.max_tokens for n, r in zip(negatives, requests, strict=True))
    params = torch.tensor([g.row() for g in specs])
    pair, cache, logits = prefill_pair(engine.model, engine.model, prompts, negatives, (capacity, second), params,
                                       guidance_scores, ledger)
    return pair, cache, logits


class BeamRunner:
    """Beam search: the n best hypotheses of each request (``params.n`` <= beams)."""

    def generate(self, engine: LocalGenerator, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]:
        started = time.perf_counter()
        try:
            return self._generate(engine, requests, ledger)
        finally:
            ledger.charge(seconds=time.perf_counter() - started)

    def _generate(self, engine: LocalGenerator, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]:
        specs = [r.decoder for r in requests if isinstance(r.decoder, BeamParams)]
        prompts = [engine.encode_prompt(r.prompt) for r in requests]
        prepared = [prepare(p, r.constraint, r.token_healing, engine.vocabulary) if r.constraint is not None or r.token_healing
                    else None for p, r in zip(prompts, requests, strict=True)]
        prompts = [list(h.ids) if h is not None else p for p, h in zip(prompts, prepared, strict=True)]
        for p, r, spec in zip(prompts, requests, specs, strict=True):  # validate everything before any compute
            engine._check(p, r)
            spec.check_sampling(r.params)
        capacity = max(len(p) + r.params.max_tokens for p, r in zip(prompts, requests, strict=True))
        ledger.charge(input_tokens=sum(len(p) for p in prompts))
        model, cache, logits = engine.prefill_prompts(prompts, capacity, ledger)
        sampler = make_sampler([dataclasses.replace(r.params, temperature=0.0) for r in requests], model.vocab_size,
                               logits.device, encode=lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
        eos = engine.tokenizer.eos_token_ids
        rows = [RowState(max_tokens=r.params.max_tokens, stop=r.params.stop, eos_ids=frozenset() if r.params.ignore_eos else eos)
                for r in requests]
        cursors = [h.cursor() if h is not None else None for h in prepared] if any(h is not None for h in prepared) else None
        # requests with different beam settings are searched separately (one batch per setting)
        groups: dict[BeamParams, list[int]] = {}
        for i, spec in enumerate(specs):
            groups.setdefault(spec, []).append(i)
        results: dict[int, list[Completion]] = {}
        for spec, members in groups.items():
            sub = cache.fork(members) if len(groups) > 1 else cache
            hyps = beam_search(model, engine.tokenizer, sub, logits[torch.as_tensor(members, device=logits.device)],
                               sampler.select(members), [rows[i] for i in members], spec, ledger,
                               state=sampler.select(members).start([prompts[i] for i in members]),
                               cursors=None if cursors is None else [cursors[i] for i in members])
            for i, found in zip(members, hyps, strict=True):
                results[i] = [Completion(text=h.text, token_ids=h.tokens, logprobs=h.logprobs, finish_reason=h.finish_reason,
                                         score=h.score) for h in found[:requests[i].params.n]]
        return [results[i] for i in range(len(requests))]

    def stream(self, engine: LocalGenerator, request: Request, ledger: Ledger) -> Iterator[StreamChunk]:
        """Beam search knows its best hypothesis only at the end: one chunk."""
        if request.params.n != 1:
            raise InvalidParameter("n", request.params.n, "1 when streaming")
        best = self.generate(engine, [request], ledger)[0][0]
        yield StreamChunk(best.text, best.token_ids, best.finish_reason)


RUNNERS: dict[type, Runner] = {
    type(None): TokenRunner(),
    ContrastiveParams: TokenRunner(_start_contrastive),
    GuidanceParams: TokenRunner(_start_guidance),
    BeamParams: BeamRunner(),
}


def runner_for(decoder: Any) -> Runner:
    runner = RUNNERS.get(type(decoder))
    if runner is None:
        raise InvalidParameter("decoder", type(decoder).__name__, f"one of {[t.__name__ for t in RUNNERS]}")
    return runner


def generate(engine: LocalGenerator, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]:
    """Run each decoder type's requests as one batch; results in request order."""
    groups: dict[type, list[int]] = {}
    for i, r in enumerate(requests):
        runner_for(r.decoder)  # unknown decoders fail before any compute
        groups.setdefault(type(r.decoder), []).append(i)
    out: list[list[Completion]] = [[] for _ in requests]
    for kind, members in groups.items():
        for i, completions in zip(members, RUNNERS[kind].generate(engine, [requests[i] for i in members], ledger), strict=True):
            out[i] = completions
    return out
