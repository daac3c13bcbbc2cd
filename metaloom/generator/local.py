"""The local engine as a `Generator`: every request is validated and prepared first
(`metaloom.generator.plan`), then its rows are admitted to the one decode loop
(`metaloom.decode.batch`): each prompt prefilled once and forked ``n`` ways (the native model's
KV pool shares the prompt's keys instead of copying them), every forward charged to the ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch

from metaloom.constrain import Vocabulary
from metaloom.decode.batch import DecodeBatch
from metaloom.decode.beam import beam_steps, finish
from metaloom.decode.contrastive import LockstepPair, check_same_vocab, contrastive_scores, guidance_scores
from metaloom.decode.joining import NewRow, Prefill, Row, row_state
from metaloom.decode.overhead import measure_overhead
from metaloom.decode.prefill import prefill, prefill_cached, prefill_pair, release_cache
from metaloom.decode.rows import RowState
from metaloom.decode.score import PromptPosition, prompt_logprobs, score_continuations, split_continuation
from metaloom.decode.specs import BeamParams, ContrastiveParams
from metaloom.errors import BudgetExceeded, InvalidParameter, Unsupported, UnsupportedModel
from metaloom.generator.capabilities import FEATURES, Capabilities
from metaloom.generator.plan import Plan, check_ids, encode, plan
from metaloom.generator.types import Completion, Message, Prompt, Request, Scored, StreamChunk, TokenIds, check_prompt
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.models.protocols import LanguageModel
from metaloom.prefix.pool import PrefixCache
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative import Speculative


class LocalGenerator:
    """``prefix_cache``: an optional `metaloom.prefix.PrefixCache` kept across calls; prompts
    then compute only what is not cached (charged as ``cached_tokens``), and every finished
    sample's tokens are stored too, so continuing a partial output prefills almost nothing.
    ``amateur``: the second model of contrastive decoding (same tokenizer), if any.
    ``speculative``: draft-and-verify decoding (`metaloom.speculative.Speculative`) for requests
    decoded through the sampling pipeline; same outputs (greedy) or distribution (sampling).
    ``prefill_overhead_tokens``: the fixed cost of a prefill forward in prompt tokens, which
    decides how prompts of mixed lengths are grouped into forwards; None measures it on first
    need (`metaloom.decode.overhead`)."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None = None,
                 amateur: LanguageModel | None = None, speculative: Speculative | None = None,
                 prefill_overhead_tokens: int | None = None) -> None:
        if prefill_overhead_tokens is not None and (not isinstance(prefill_overhead_tokens, int)
                                                    or isinstance(prefill_overhead_tokens, bool)
                                                    or prefill_overhead_tokens < 0):
            raise InvalidParameter("prefill_overhead_tokens", prefill_overhead_tokens, "an integer >= 0")
        self._prefill_overhead = prefill_overhead_tokens
        options = getattr(loaded.model, "options", None)
        if speculative is not None and options is not None and options.drops:
            # a verify step rolls its rejected drafts back by position, and a policy may cut a
            # row inside the verify forward (metaloom.models.engine.dropping): not both, yet
            raise InvalidParameter("speculative", speculative.drafter.name,
                                   f"off with --kv-policy {options.kv_policy!r} (token dropping and speculative "
                                   "decoding do not run together yet)")
        self.speculative = speculative
        if amateur is not None:
            check_same_vocab(loaded.model, amateur)
        self.amateur = amateur
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = f"the local engine ({loaded.name})"
        # the engine's KV memory: every cache of this engine lives here, so rows fork and join
        # without copying keys, and the prefix cache refers to them in place
        new_pool = getattr(self.model, "new_pool", None)
        self.pool = new_pool() if new_pool is not None else None
        amateur_pool = getattr(amateur, "new_pool", None)
        self.amateur_pool = amateur_pool() if amateur_pool is not None else None
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            if self.pool is None:
                raise UnsupportedModel(f"{type(self.model).__name__} keeps no KV pool the prefix cache can refer to; "
                                       "use the native backend or no prefix cache")
            prefix_cache.bind(self.pool)
        decoders = {"beam", "cfg"} | ({"contrastive"} if amateur is not None else set())
        self.capabilities = Capabilities(decoders=frozenset(decoders), features=FEATURES)
        self._vocabulary: Vocabulary | None = None

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as the grammar engine sees it; built on first use (constraints, healing)."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.model.vocab_size)
        return self._vocabulary

    def prefill_overhead_tokens(self) -> int:
        """The fixed cost of one more prefill forward, in prompt tokens: as given, or measured
        once on this engine's model (`metaloom.decode.overhead.measure_overhead`)."""
        if self._prefill_overhead is None:
            self._prefill_overhead = measure_overhead(self.model, self.pool)
        return self._prefill_overhead

    # --- the Generator protocol ----------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        return self.tokenizer.apply_chat_template(list(messages))

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        plans = [plan(self, r) for r in requests]  # everything validated before any compute
        started = time.perf_counter()
        try:
            out: list[list[Completion]] = [[] for _ in plans]
            kinds: dict[type, list[int]] = {}
            for i, p in enumerate(plans):
                kinds.setdefault(p.kind, []).append(i)
            for kind, members in kinds.items():
                chosen = [plans[i] for i in members]
                results = self._beam(chosen, ledger) if kind is BeamParams else self._decode(chosen, ledger)
                for i, completions in zip(members, results, strict=True):
                    out[i] = completions
            return out
        finally:
            _charge_time(ledger, time.perf_counter() - started)

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        p = plan(self, request)  # a bad request raises here, at the call, not at the first next()
        return self._stream(p, ledger)

    def score(self, prompt: Prompt, continuations: Sequence[str | TokenIds], *, ledger: Ledger) -> list[Scored]:
        check_prompt(prompt)
        if not continuations:
            return []
        if isinstance(prompt, TokenIds):
            context_ids: list[int] = list(prompt.ids)
            context_text = None
        else:
            context_ids = encode(self, prompt)
            context_text = prompt if isinstance(prompt, str) else self.render(prompt)
        conts: list[list[int]] = []
        for i, c in enumerate(continuations):
            if isinstance(c, TokenIds):
                conts.append(list(c.ids))
            elif isinstance(c, str) and c:
                if context_text is None:
                    conts.append(self.tokenizer.encode(c, add_special_tokens=False))
                else:
                    ctx, ids = split_continuation(self.tokenizer, context_text, c,
                                                  add_special_tokens=isinstance(prompt, str))
                    if ctx != context_ids:  # the context must be the one scored
                        ids = self.tokenizer.encode(c, add_special_tokens=False)
                    conts.append(ids)
            else:
                raise InvalidParameter(f"continuations[{i}]", c, "non-empty text or TokenIds")
        check_ids("prompt ids", context_ids, self.model.vocab_size)
        for c_ids in conts:
            check_ids("continuation ids", c_ids, self.model.vocab_size)
        started = time.perf_counter()
        try:
            scored = score_continuations(self.model, context_ids, conts, ledger, pool=self.pool,
                                         prefix_cache=self.prefix_cache)
        finally:
            _charge_time(ledger, time.perf_counter() - started)
        return [Scored(c if isinstance(c, str) else self.tokenizer.decode(list(c.ids)), s.tokens, s.logprobs)
                for c, s in zip(continuations, scored, strict=True)]

    def prompt_logprobs(self, prompt: Prompt, k: int, *, ledger: Ledger,
                        count_input: bool = True) -> tuple[list[int], list[PromptPosition]]:
        """The prompt's ids as the model reads them, and each one's log-probability after those
        before it with the ``k`` most likely tokens there (`metaloom.decode.score.prompt_logprobs`;
        the server's ``echo`` and ``prompt_logprobs``)."""
        check_prompt(prompt)
        ids = list(prompt.ids) if isinstance(prompt, TokenIds) else encode(self, prompt)
        check_ids("prompt ids", ids, self.model.vocab_size)
        started = time.perf_counter()
        try:
            return ids, prompt_logprobs(self.model, ids, k, ledger, pool=self.pool, count_input=count_input)
        finally:
            _charge_time(ledger, time.perf_counter() - started)

    # --- the decode loop, for callers that drive it (the server's scheduler) ----------------------
    def new_batch(self, decoder: type | None = None) -> DecodeBatch:
        """An empty decode loop for requests decoded by ``decoder`` (the type of their
        ``Request.decoder``: None for the sampling pipeline, `ContrastiveParams`,
        `GuidanceParams`); rows join it through `rows_for` and `DecodeBatch.admit`."""
        if decoder is None or decoder is type(None):
            return DecodeBatch(self.model, self.tokenizer, self._plain_prefill(), speculative=self.speculative,
                               prefix_cache=self.prefix_cache, prefill_overhead=self.prefill_overhead_tokens)
        if decoder is BeamParams:
            raise UnsupportedModel("beam search reorders its rows every step; it runs as a whole (generate)")
        pair, run = self._pair_prefill(decoder)
        return DecodeBatch(pair, self.tokenizer, run, prefill_overhead=self.prefill_overhead_tokens)

    def rows_for(self, request: Request, ledger: Ledger, tag: Any = None) -> list[NewRow]:
        """The rows of ``request`` (validated and prepared: a bad request raises here)."""
        return plan(self, request).rows(ledger, self.model.device, tag)

    # --- runs --------------------------------------------------------------------------------------
    def _decode(self, plans: list[Plan], ledger: Ledger) -> list[list[Completion]]:
        batch = self.new_batch(plans[0].kind)
        handles: list[list[Row]] = []
        try:
            rows = batch.admit([r for i, p in enumerate(plans) for r in p.rows(ledger, self.model.device, i)])
            it = iter(rows)
            handles = [[next(it) for _ in range(p.request.params.n)] for p in plans]
            while batch.rows:
                batch.step()
        finally:
            batch.close()
        return [[completion(r.state) for r in rs] for rs in handles]

    def _stream(self, p: Plan, ledger: Ledger) -> Iterator[StreamChunk]:
        if p.kind is BeamParams:  # beam search knows its hypotheses only at the end
            for i, c in enumerate(self.generate([p.request], ledger=ledger)[0]):
                yield StreamChunk(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, i, c.error,
                                  c.top_logprobs or ())
            return
        started = time.perf_counter()
        batch = self.new_batch(p.kind)
        try:
            rows = batch.admit(p.rows(ledger, self.model.device))
            yield from chunks(rows)
            while batch.rows:
                batch.step()
                yield from chunks(rows)
        finally:
            batch.close()  # a closed stream cancels what is left
            _charge_time(ledger, time.perf_counter() - started)

    def _plain_prefill(self) -> Prefill:
        def run(reps: Sequence[NewRow], capacity: int, ledgers: list[Ledger]) -> tuple[Any, torch.Tensor, torch.Tensor]:
            prompts = [list(r.prompt) for r in reps]
            if self.prefix_cache is not None and self.pool is not None:
                cache, logits = prefill_cached(self.model, prompts, capacity, ledgers, self.prefix_cache, pool=self.pool)
            else:
                cache, logits = prefill(self.model, prompts, capacity, ledgers, pool=self.pool)
            return cache, logits, logits
        return run

    def _pair_prefill(self, decoder: type) -> tuple[LockstepPair, Prefill]:
        contrastive = decoder is ContrastiveParams
        secondary = self.amateur if contrastive else self.model
        if secondary is None:
            raise Unsupported("decoder contrastive", self.name, "no amateur model (LocalGenerator(amateur=...))")
        combine = contrastive_scores if contrastive else guidance_scores
        defaults = (0.1, 1.0) if contrastive else (1.5,)
        pair = LockstepPair(self.model, secondary, combine, defaults)
        second_pool = self.amateur_pool if contrastive else self.pool

        def run(reps: Sequence[NewRow], capacity: int, ledgers: list[Ledger]) -> tuple[Any, torch.Tensor, torch.Tensor]:
            prompts = [list(r.prompt) for r in reps]
            seconds = [list(r.secondary) if r.secondary is not None else list(r.prompt) for r in reps]
            if not contrastive:  # the unconditional stream's prompt is an input too
                for r, s in zip(reps, seconds, strict=True):
                    with contextlib.suppress(BudgetExceeded):
                        r.ledger.charge(input_tokens=len(s))
            second_capacity = max(len(s) + r.room for s, r in zip(seconds, reps, strict=True))
            params = torch.tensor([list(r.combine) for r in reps], dtype=torch.float32)
            return prefill_pair(pair, prompts, seconds, (capacity, second_capacity), params, ledgers,
                                (self.pool, second_pool))
        return pair, run

    def _beam(self, plans: list[Plan], ledger: Ledger) -> list[list[Completion]]:
        """Beam search: the n best hypotheses of each request (``params.n`` <= beams); requests
        with different beam settings are searched separately."""
        groups: dict[BeamParams, list[int]] = {}
        for i, p in enumerate(plans):
            assert isinstance(p.request.decoder, BeamParams)
            groups.setdefault(p.request.decoder, []).append(i)
        results: dict[int, list[Completion]] = {}
        for spec, members in groups.items():
            chosen = [plans[i] for i in members]
            for i, found in zip(members, self._beam_group(chosen, spec, ledger), strict=True):
                results[i] = found
        return [results[i] for i in range(len(plans))]

    def _beam_group(self, plans: list[Plan], spec: BeamParams, ledger: Ledger) -> list[list[Completion]]:
        return finish(self.beam_steps(plans, spec, ledger))

    def beam_steps(self, plans: list[Plan], spec: BeamParams,
                   ledger: Ledger) -> Generator[None, None, list[list[Completion]]]:
        """Beam search over ``plans`` (one shared `BeamParams`), pausing after each forward
        (`metaloom.decode.beam.beam_steps`): the server interleaves it with its decode loop.
        Each prompt's rows are set up as the decode loop's are (`Plan.rows`, `row_state`), one
        per prompt: beams fork from it."""
        firsts = [p.rows(ledger, self.model.device)[0] for p in plans]
        ledger.charge(input_tokens=sum(len(r.prompt) for r in firsts))
        capacity = max(r.capacity for r in firsts)
        cache, logits = prefill(self.model, [list(r.prompt) for r in firsts], capacity, ledger, pool=self.pool)
        try:
            yield  # a pause after the prefill's forward too
        except GeneratorExit:
            release_cache(cache)
            raise
        # beams rank log-probabilities: the pipeline's greedy path (BeamParams.check_sampling allowed temperature 1)
        params = [dataclasses.replace(r.params, temperature=0.0) for r in firsts]
        sampler = make_sampler(params, self.model.vocab_size, logits.device,
                               encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        rows = [row_state(self.tokenizer, r) for r in firsts]
        cursors = [r.cursor for r in firsts]
        state = sampler.start([list(r.prompt[:len(r.prompt) - r.prefix]) for r in firsts],
                              [list(r.prompt[len(r.prompt) - r.prefix:]) for r in firsts])
        hyps = yield from beam_steps(self.model, cache, logits, sampler, rows, spec, ledger, state=state,
                                     cursors=cursors if any(c is not None for c in cursors) else None)
        return [[Completion(text=h.text, token_ids=h.tokens, logprobs=h.logprobs, finish_reason=h.finish_reason,
                            stop_reason=h.stop_reason, score=h.score, top_logprobs=h.top_logprobs)
                 for h in found[:p.request.params.n]]
                for p, found in zip(plans, hyps, strict=True)]


def completion(state: RowState) -> Completion:
    """A finished row as a `Completion`."""
    assert state.finish_reason is not None
    return Completion(text=state.text, token_ids=tuple(state.tokens), logprobs=tuple(state.logprobs),
                      finish_reason=state.finish_reason, stop_reason=state.stop_reason,
                      decoder_logprobs=tuple(state.scores) if state.scores else None, error=state.error,
                      top_logprobs=tuple(state.top) if state.top_k else None)


def chunks(rows: Sequence[Row]) -> Iterator[StreamChunk]:
    """A chunk for each row with new tokens since the last call, or whose finish is not yet
    reported (``StreamChunk.index``: the row's sample index)."""
    for i, row in enumerate(rows):
        s = row.state
        if s.sent == len(s.tokens) and (not s.done or s.closed):
            continue
        new = slice(s.sent, len(s.tokens))
        s.sent, s.closed = len(s.tokens), s.done
        yield StreamChunk(s.pending_text(), tuple(s.tokens[new]), tuple(s.logprobs[new]), s.finish_reason,
                          s.stop_reason, i, s.error, tuple(s.top[new]))


def _charge_time(ledger: Ledger, seconds: float) -> None:
    with contextlib.suppress(BudgetExceeded):
        ledger.charge(seconds=seconds)
