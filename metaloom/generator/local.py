"""The local engine as a `Generator`: batches requests, prefills each prompt once, forks the
cache ``n`` ways for ``n`` samples, and charges the ledger for every forward."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from metaloom.constrain import Vocabulary
from metaloom.decode.contrastive import check_same_vocab
from metaloom.decode.healing import Prepared, prepare
from metaloom.decode.loop import decode, prefill, prefill_cached
from metaloom.decode.rows import RowState
from metaloom.errors import ContextWindowExceeded, InvalidParameter, UnsupportedModel
from metaloom.generator import decoders
from metaloom.generator.types import Completion, Request, StreamChunk
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.prefix.pool import BlockKVCache, PrefixCache
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative import Speculative


class LocalGenerator:
    """``prefix_cache``: an optional `metaloom.prefix.PrefixCache` kept across calls; prompts
    then compute only what is not cached (charged as ``cached_tokens``). One per model.
    ``amateur``: the second model of contrastive decoding (same tokenizer), if any.
    ``speculative``: draft-and-verify decoding (`metaloom.speculative.Speculative`) for requests
    decoded through the sampling pipeline; same outputs (greedy) or distribution (sampling).

    Each request's ``decoder`` picks how it is run (`metaloom.generator.decoders.RUNNERS`)."""

    def __init__(self, loaded: LoadedModel, prefix_cache: PrefixCache | None = None,
                 amateur: LanguageModel | None = None, speculative: Speculative | None = None) -> None:
        self.speculative = speculative
        if amateur is not None:
            check_same_vocab(loaded.model, amateur)
        self.amateur = amateur
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            if not isinstance(self.model.new_cache(1, 1), BlockKVCache):
                raise UnsupportedModel(f"{type(self.model).__name__} has no KV cache the prefix cache can copy "
                                       "(read_block/append_block); use the native backend or no prefix cache")
            prefix_cache.bind(self.model)
        self._vocabulary: Vocabulary | None = None

    @property
    def vocabulary(self) -> Vocabulary:
        """The tokenizer as the grammar engine sees it; built on first use (constraints, healing)."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.model.vocab_size)
        return self._vocabulary

    def encode_prompt(self, prompt: str | tuple[dict[str, str], ...]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(prompt), add_special_tokens=False)
        if not ids:
            raise InvalidParameter("prompt", prompt, "text that encodes to at least one token")
        return ids

    def _check(self, prompt: list[int], request: Request) -> None:
        window = self.model.max_context
        if len(prompt) >= window:
            raise ContextWindowExceeded(len(prompt), window)
        if len(prompt) + request.params.max_tokens > window:
            raise ContextWindowExceeded(len(prompt) + request.params.max_tokens, window,
                                        f"prompt ({len(prompt)} tokens) plus max_tokens")
        request.params.check_vocab(self.model.vocab_size)

    def prefill_prompts(self, prompts: list[list[int]], capacity: int,
                        ledger: Ledger) -> tuple[LanguageModel, KVCache, torch.Tensor]:
        """(model, cache, next-token logits [B, V]) after prefilling ``prompts`` (through the
        prefix cache when there is one)."""
        if self.prefix_cache is None:
            cache, logits = prefill(self.model, prompts, capacity, ledger)
        else:
            cache, logits = prefill_cached(self.model, prompts, capacity, ledger, self.prefix_cache)
        return self.model, cache, logits

    def _run(self, requests: Sequence[Request], ledger: Ledger,
             start: decoders.Start | None = None) -> Iterator[tuple[list[RowState], list[int]]]:
        """Shared by `generate` and `stream`: yields (rows, rows stepped) after every step.
        ``start`` prefills a different model to decode with (contrastive, guidance)."""
        if not requests:
            return
        prompts = [self.encode_prompt(r.prompt) for r in requests]
        # token healing and grammar compilation (a bad grammar raises here, before any compute)
        prepared: list[Prepared | None] = [
            prepare(p, r.constraint, r.token_healing, self.vocabulary) if r.constraint is not None or r.token_healing
            else None for p, r in zip(prompts, requests, strict=True)]
        prompts = [list(h.ids) if h is not None else p for p, h in zip(prompts, prepared, strict=True)]
        for p, r in zip(prompts, requests, strict=True):  # validate everything before any compute
            self._check(p, r)
        capacity = max(len(p) + r.params.max_tokens for p, r in zip(prompts, requests, strict=True))
        ledger.charge(input_tokens=sum(len(p) for p in prompts))
        if start is None:
            model, cache, logits = self.prefill_prompts(prompts, capacity, ledger)
        else:
            model, cache, logits = start(self, requests, prompts, capacity, ledger)
        # one output row per sample; rows of a request share its prompt's cache and its RNG
        owner = [i for i, r in enumerate(requests) for _ in range(r.params.n)]
        if owner != list(range(len(requests))):
            cache = cache.fork(owner)
            logits = logits[torch.as_tensor(owner, device=logits.device)]
        generators = []
        for r in requests:
            g = None
            if not r.params.greedy:
                g = torch.Generator(device=self.model.device)
                g.manual_seed(r.params.seed if r.params.seed is not None else int(torch.seed() % (2**63)))
            generators.append(g)
        eos = self.tokenizer.eos_token_ids
        rows = [RowState(max_tokens=requests[i].params.max_tokens, stop=requests[i].params.stop,
                         eos_ids=frozenset() if requests[i].params.ignore_eos else eos) for i in owner]
        sampler = make_sampler([requests[i].params for i in owner], self.model.vocab_size, logits.device,
                               encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        state = sampler.start([prompts[i] for i in owner])
        constraints = None
        if any(h is not None for h in prepared):
            constraints = [h.cursor() if (h := prepared[i]) is not None else None for i in owner]  # one per row
        row_generators = [generators[i] for i in owner]
        if self.speculative is not None and start is None:
            steps = self.speculative.decode(model, self.tokenizer, cache, logits, sampler, rows, row_generators, ledger,
                                            prompts=[prompts[i] for i in owner], state=state, constraints=constraints)
        else:
            steps = decode(model, self.tokenizer, cache, logits, sampler, rows, row_generators, ledger,
                           state=state, constraints=constraints)
        for stepped in steps:
            yield rows, stepped

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        return decoders.generate(self, requests, ledger)

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        return decoders.runner_for(request.decoder).stream(self, request, ledger)

    def _generate(self, requests: Sequence[Request], ledger: Ledger,
                  prefill_with: decoders.Start | None = None) -> list[list[Completion]]:
        start = time.perf_counter()
        rows: list[RowState] = []
        try:
            for step_rows, _ in self._run(requests, ledger, prefill_with):
                rows = step_rows
        finally:
            ledger.charge(seconds=time.perf_counter() - start)
        out: list[list[Completion]] = []
        it = iter(rows)
        for r in requests:
            out.append([_completion(next(it)) for _ in range(r.params.n)])
        return out

    def _stream(self, request: Request, ledger: Ledger, prefill_with: decoders.Start | None = None) -> Iterator[StreamChunk]:
        if request.params.n != 1:
            raise InvalidParameter("n", request.params.n, "1 when streaming")
        start = time.perf_counter()
        try:
            sent = 0  # tokens already streamed (a speculative step emits several)
            for rows, stepped in self._run([request], ledger, prefill_with):
                row = rows[0]
                if stepped:
                    yield StreamChunk(row.pending_text(), tuple(row.tokens[sent:]), row.finish_reason)
                    sent = len(row.tokens)
        finally:
            ledger.charge(seconds=time.perf_counter() - start)


def _completion(row: RowState) -> Completion:
    assert row.finish_reason is not None
    return Completion(text=row.text, token_ids=tuple(row.tokens), logprobs=tuple(row.logprobs),
                      finish_reason=row.finish_reason)
