"""Prefill and the token loop shared by greedy and sampling decoding.

`prefill` runs prompts of different lengths in one right-padded forward; `decode` then steps
all rows together, one token per row per forward, drawing through the single logits pipeline
(`metaloom.sampling.pipeline`). It yields after every step so callers can stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from metaloom.decode.forward import charged_forward
from metaloom.decode.rows import RowState
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.sampling.pipeline import Sampler


def prefill(model: LanguageModel, prompts: Sequence[Sequence[int]], capacity: int,
            ledger: Ledger) -> tuple[KVCache, torch.Tensor]:
    """Run the prompts into a fresh cache. Returns (cache, logits [B, V] at each prompt's last token)."""
    b, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros(b, longest, dtype=torch.long, device=model.device)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)
    valid = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=model.device)
    cache = model.new_cache(b, capacity)
    logits = charged_forward(model, tokens, cache, ledger, valid=valid, last_only=True)
    return cache, logits[:, -1]


def _compact(cache: KVCache, live: list[int], *state: torch.Tensor | None) -> tuple[KVCache, list[torch.Tensor | None]]:
    index = torch.as_tensor(live, dtype=torch.long)
    return cache.fork(live), [None if s is None else s[index.to(s.device)] for s in state]


def decode(model: LanguageModel, tokenizer: Tokenizer, cache: KVCache, logits: torch.Tensor, sampler: Sampler,
           rows: Sequence[RowState], generators: Sequence[torch.Generator | None], ledger: Ledger, *,
           seen: torch.Tensor | None = None) -> Iterator[list[int]]:
    """Generate until every row is done. ``logits`` [R, V] are the model's next-token logits
    for each row; ``seen`` [R, V] bool marks prompt tokens (repetition penalty).

    Yields, after each step, the indices of the rows that received a token. Finished rows are
    dropped from the batch once half of the batch has finished, so their compute stops too.
    """
    live = list(range(len(rows)))  # row index of each batch position
    counts = torch.zeros(len(rows), model.vocab_size, dtype=torch.int32, device=logits.device) if sampler.any_penalty else None
    if sampler.any_penalty and seen is None:
        seen = torch.zeros(len(rows), model.vocab_size, dtype=torch.bool, device=logits.device)
    batch_sampler = sampler
    while True:
        logprobs = batch_sampler.process(logits, counts, seen)
        tokens = batch_sampler.draw(logprobs, [generators[r] for r in live])
        model_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]
        stepped = []
        for pos, r in enumerate(live):
            if not rows[r].done:
                rows[r].append(int(tokens[pos]), float(model_logprobs[pos]), tokenizer)
                stepped.append(r)
        ledger.charge(output_tokens=len(stepped))
        yield stepped
        if all(rows[r].done for r in live):
            return
        if counts is not None and seen is not None:
            counts[torch.arange(len(live)), tokens] += 1
            seen[torch.arange(len(live)), tokens] = True
        still = [pos for pos, r in enumerate(live) if not rows[r].done]
        if len(still) <= len(live) // 2:
            cache, (tokens, counts, seen) = _compact(cache, still, tokens, counts, seen)
            assert tokens is not None
            live = [live[pos] for pos in still]
            batch_sampler = sampler.select([r for r in live])
        logits = charged_forward(model, tokens[:, None], cache, ledger)[:, -1]
