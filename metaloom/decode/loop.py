"""Prefill and the token loop shared by greedy and sampling decoding.

`prefill` runs prompts of different lengths in one right-padded forward; `decode` then steps
all rows together, one token per row per forward, drawing through the single logits pipeline
(`metaloom.sampling.pipeline`). It yields after every step so callers can stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from metaloom.constrain import Constraint, batch_mask
from metaloom.decode.forward import charged_forward
from metaloom.decode.rows import RowState
from metaloom.errors import UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.prefix.pool import BlockKVCache, PrefixCache
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState


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


def prefill_cached(model: LanguageModel, prompts: Sequence[Sequence[int]], capacity: int, ledger: Ledger,
                   prefix_cache: PrefixCache) -> tuple[KVCache, torch.Tensor]:
    """`prefill` through a radix prefix cache: each row starts from its prompt's longest cached
    prefix (copied in) and computes only the rest; then every prompt is stored for later calls.

    The last prompt token is always computed, since its logits are needed. Rows start at
    different lengths, so the tails are right-padded (``valid``) and the cache is made large
    enough for the longest start plus the longest tail. Charges ``cached_tokens``; FLOPs are
    charged by `charged_forward` for the computed tokens only.
    """
    hits = [prefix_cache.match(p[:-1]) for p in prompts]
    try:
        cached = [h.length for h in hits]
        # padding positions run to max(start) + max(tail): keep them inside the context window
        while max(cached) + max(len(p) - c for p, c in zip(prompts, cached, strict=True)) > model.max_context:
            worst = max(range(len(prompts)), key=lambda i: cached[i])
            prefix_cache.release(hits[worst])
            hits[worst], cached[worst] = prefix_cache.match(()), 0
        tails = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        longest = max(len(t) for t in tails)
        cache = model.new_cache(len(prompts), max(capacity, max(cached) + longest))
        if not isinstance(cache, BlockKVCache):
            raise UnsupportedModel(f"{type(cache).__name__} cannot copy KV blocks (read_block/append_block); "
                                   "the prefix cache needs the native model")
        for row, hit in enumerate(hits):
            prefix_cache.load(hit, cache, row)
        tokens = torch.zeros(len(prompts), longest, dtype=torch.long, device=model.device)
        for i, t in enumerate(tails):
            tokens[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
        valid = torch.tensor([len(t) for t in tails], dtype=torch.long, device=model.device)
        ledger.charge(cached_tokens=sum(cached))
        logits = charged_forward(model, tokens, cache, ledger, valid=valid, last_only=True)
        for row, p in enumerate(prompts):
            prefix_cache.insert(p, cache, row)
    finally:
        for h in hits:
            prefix_cache.release(h)
    return cache, logits[:, -1]


def _compact(cache: KVCache, live: list[int], tokens: torch.Tensor) -> tuple[KVCache, torch.Tensor]:
    """Keep only the batch positions ``live``: a smaller cache and those rows' last tokens."""
    return cache.fork(live), tokens[torch.as_tensor(live, dtype=torch.long, device=tokens.device)]


def decode(model: LanguageModel, tokenizer: Tokenizer, cache: KVCache, logits: torch.Tensor, sampler: Sampler,
           rows: Sequence[RowState], generators: Sequence[torch.Generator | None], ledger: Ledger, *,
           state: SamplingState | None = None, constraints: Sequence[Constraint | None] | None = None) -> Iterator[list[int]]:
    """Generate until every row is done. ``logits`` [R, V] are the model's next-token logits
    for each row; ``state`` is the pipeline's per-row state (`Sampler.start(prompts)`: penalties,
    DRY and n-grams see the prompts; None starts from empty prompts);
    ``constraints[r]`` is row r's cursor (`metaloom.constrain`) or None: its mask is pipeline
    step 3, it advances after every draw, and the row finishes ("stop") once only an end
    token could follow.

    Yields, after each step, the indices of the rows that received a token. Finished rows are
    dropped from the batch once half of the batch has finished, so their compute stops too.
    """
    live = list(range(len(rows)))  # row index of each batch position
    if state is None:
        state = sampler.start()
    batch_sampler = sampler
    while True:
        mask = None
        if constraints is not None:
            mask = batch_mask([None if rows[r].done else constraints[r] for r in live], logits.shape[-1], logits.device)
        live_generators = [generators[r] for r in live]
        logprobs = batch_sampler.process(logits, state, mask=mask, generators=live_generators)
        tokens = batch_sampler.draw(logprobs, live_generators)
        state = batch_sampler.advance(state, tokens, logprobs)
        model_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]
        stepped = []
        for pos, r in enumerate(live):
            if not rows[r].done:
                rows[r].append(int(tokens[pos]), float(model_logprobs[pos]), tokenizer)
                stepped.append(r)
                if constraints is not None and (cursor := constraints[r]) is not None:
                    cursor.advance(int(tokens[pos]))
                    if cursor.done() and not rows[r].done:
                        rows[r].finish_reason = "stop"
        ledger.charge(output_tokens=len(stepped))
        yield stepped
        if all(rows[r].done for r in live):
            return
        still = [pos for pos, r in enumerate(live) if not rows[r].done]
        if len(still) <= len(live) // 2:
            cache, tokens = _compact(cache, still, tokens)
            state = state.select(still)
            live = [live[pos] for pos in still]
            batch_sampler = sampler.select([r for r in live])
        logits = charged_forward(model, tokens[:, None], cache, ledger)[:, -1]
