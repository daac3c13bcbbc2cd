"""The local engine as a `Generator`: batches requests, prefills each prompt once, forks the
cache ``n`` ways for ``n`` samples, and charges the ledger for every forward."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from metaloom.decode.loop import decode, prefill
from metaloom.decode.rows import RowState
from metaloom.errors import ContextWindowExceeded, InvalidParameter
from metaloom.generator.types import Completion, Request, StreamChunk
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling.pipeline import make_sampler


class LocalGenerator:
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer

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

    def _run(self, requests: Sequence[Request], ledger: Ledger) -> Iterator[tuple[list[RowState], list[int]]]:
        """Shared by `generate` and `stream`: yields (rows, rows stepped) after every step."""
        if not requests:
            return
        prompts = [self.encode_prompt(r.prompt) for r in requests]
        for p, r in zip(prompts, requests, strict=True):  # validate everything before any compute
            self._check(p, r)
        capacity = max(len(p) + r.params.max_tokens for p, r in zip(prompts, requests, strict=True))
        ledger.charge(input_tokens=sum(len(p) for p in prompts))
        cache, logits = prefill(self.model, prompts, capacity, ledger)
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
        sampler = make_sampler([requests[i].params for i in owner], self.model.vocab_size, logits.device)
        seen = None
        if sampler.any_penalty:
            seen = torch.zeros(len(owner), self.model.vocab_size, dtype=torch.bool, device=logits.device)
            for row, i in enumerate(owner):
                seen[row, torch.as_tensor(prompts[i], device=logits.device)] = True
        for stepped in decode(self.model, self.tokenizer, cache, logits, sampler, rows,
                              [generators[i] for i in owner], ledger, seen=seen):
            yield rows, stepped

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        start = time.perf_counter()
        rows: list[RowState] = []
        try:
            for step_rows, _ in self._run(requests, ledger):
                rows = step_rows
        finally:
            ledger.charge(seconds=time.perf_counter() - start)
        out: list[list[Completion]] = []
        it = iter(rows)
        for r in requests:
            out.append([_completion(next(it)) for _ in range(r.params.n)])
        return out

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        if request.params.n != 1:
            raise InvalidParameter("n", request.params.n, "1 when streaming")
        start = time.perf_counter()
        try:
            for rows, stepped in self._run([request], ledger):
                row = rows[0]
                if stepped:
                    yield StreamChunk(row.pending_text(), (row.tokens[-1],), row.finish_reason)
        finally:
            ledger.charge(seconds=time.perf_counter() - start)


def _completion(row: RowState) -> Completion:
    assert row.finish_reason is not None
    return Completion(text=row.text, token_ids=tuple(row.tokens), logprobs=tuple(row.logprobs),
                      finish_reason=row.finish_reason)
