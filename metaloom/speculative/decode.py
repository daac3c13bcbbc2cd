"""The speculative decode loop: draft, verify in one forward, accept, roll back.

Same contract as `metaloom.decode.loop.decode` (same rows, state, constraints, yields), so the
generator swaps one for the other. Each step, row b drafts up to ``num_draft`` tokens after
its pending token; the target scores ``[pending, draft]`` in one right-padded forward (rows
draft different counts), `metaloom.speculative.core.accept` keeps a prefix and draws one more
token, and the cache is truncated per row to what was kept. Tokens are appended one at a time
through `RowState.append`, so end-of-sequence, stop strings, constraints finishing and
``max_tokens`` end a row exactly where the plain loop would (nothing past them is emitted).

Accounting (`Ledger`): ``drafted_tokens``, ``accepted_tokens``, ``rejected_tokens`` count draft
tokens by their verification outcome; ``verify_steps`` counts row-verifications (a batch
forward verifying three rows is three steps), so accepted / verify_steps is the mean number of
draft tokens kept per step and output / verify_steps (about) the tokens per target forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from metaloom.constrain import Constraint, batch_mask
from metaloom.decode.forward import charged_forward, charged_forward_hidden
from metaloom.decode.rows import RowState
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState
from metaloom.speculative.core import accept, after_step, constraint_masks, target_logprobs
from metaloom.speculative.drafter import Draft, DraftState, Verified


def speculative_decode(model: LanguageModel, tokenizer: Tokenizer, cache: KVCache, logits: torch.Tensor,
                       sampler: Sampler, rows: Sequence[RowState], generators: Sequence[torch.Generator | None],
                       ledger: Ledger, *, drafter: DraftState, prompts: Sequence[Sequence[int]], num_draft: int,
                       state: SamplingState | None = None,
                       constraints: Sequence[Constraint | None] | None = None) -> Iterator[list[int]]:
    """Generate until every row is done; see `metaloom.decode.loop.decode` for the arguments
    they share. ``drafter`` is the state from `Drafter.start`; ``prompts[r]`` row r's prompt
    ids (the drafter sees prompt + output); ``num_draft``: draft tokens per step (K).

    Yields, after each step, the indices of the rows that received tokens (one or more each).
    """
    if state is None:
        state = sampler.start()
    vocab = logits.shape[-1]
    # step 0 is the plain loop's first step: the prefill already gave the next-token logits
    mask = None
    if constraints is not None:
        mask = batch_mask(list(constraints), vocab, logits.device)
    logprobs = sampler.process(logits, state, mask=mask, generators=list(generators))
    pending = sampler.draw(logprobs, list(generators))
    state = sampler.advance(state, pending, logprobs)
    raw = torch.log_softmax(logits.float(), dim=-1).gather(-1, pending[:, None])[:, 0]
    stepped = []
    for r, row in enumerate(rows):
        _emit(row, int(pending[r]), float(raw[r]), tokenizer, constraints[r] if constraints is not None else None)
        stepped.append(r)
    ledger.charge(output_tokens=len(stepped))
    yield stepped
    contexts = [list(p) + row.tokens for p, row in zip(prompts, rows, strict=True)]
    live = list(range(len(rows)))
    batch_sampler = sampler
    while not all(rows[r].done for r in live):
        still = [pos for pos, r in enumerate(live) if not rows[r].done]
        if len(still) <= len(live) // 2:  # drop finished rows, as the plain loop does
            index = torch.as_tensor(still, dtype=torch.long, device=pending.device)
            cache, pending, state = cache.fork(still), pending[index], state.select(still)
            drafter = drafter.select(still)
            live = [live[pos] for pos in still]
            batch_sampler = sampler.select(live)
        live_gens = [generators[r] for r in live]
        cursors = [constraints[r] if constraints is not None and not rows[r].done else None for r in live]
        # never draft past max_tokens, nor past the cache (padding positions included)
        room = cache.capacity - int(cache.lengths.max()) - 1
        limits = [0 if rows[r].done else max(0, min(num_draft, room, rows[r].max_tokens - len(rows[r].tokens) - 1))
                  for r in live]
        draft = _checked(drafter.propose([contexts[r] for r in live], limits, ledger), limits, pending.device)
        tokens = torch.cat([pending[:, None], draft.tokens], dim=1)  # [B, K+1]
        start = cache.lengths.clone()
        finished = torch.tensor([rows[r].done for r in live], dtype=torch.bool, device=start.device)
        hidden = None  # [B, K+1, d]: the target's final hidden states, for drafters that need them (heads)
        if getattr(drafter, "needs_hidden", False):
            out, hidden = charged_forward_hidden(model, tokens, cache, ledger, valid=1 + draft.lengths)
        else:
            out = charged_forward(model, tokens, cache, ledger, valid=1 + draft.lengths)  # [B, K+1, V]
        masks, advanced = None, None
        if constraints is not None:
            masks, advanced = constraint_masks(cursors, draft.tokens, draft.lengths, vocab, out.device)
            for c, n in zip(cursors, advanced, strict=True):
                if c is not None and n:
                    c.rollback(n)  # re-advanced token by token below, as the plain loop does
        lp, states = target_logprobs(batch_sampler, out, draft.tokens, state, live_gens, masks)
        acceptance = accept(lp, draft.tokens, draft.lengths, draft.probs, batch_sampler.greedy, live_gens)
        state = after_step(batch_sampler, states, lp, acceptance)
        raw = torch.log_softmax(out.float(), dim=-1)
        stepped, emitted, verified_rows = [], 0, 0
        for pos, r in enumerate(live):
            if rows[r].done:
                continue
            verified_rows += 1
            for j, token in enumerate(acceptance.emitted(pos)):
                _emit(rows[r], token, float(raw[pos, j, token]), tokenizer, cursors[pos])
                contexts[r].append(token)
                emitted += 1
                if rows[r].done:
                    break
            stepped.append(r)
        live_drafts = [int(draft.lengths[pos]) for pos, r in enumerate(live) if r in stepped]
        kept = [int(acceptance.accepted[pos]) for pos, r in enumerate(live) if r in stepped]
        ledger.charge(output_tokens=emitted, drafted_tokens=sum(live_drafts), accepted_tokens=sum(kept),
                      rejected_tokens=sum(live_drafts) - sum(kept), verify_steps=verified_rows)
        # keep pending + accepted drafts; rows finished before this step keep nothing
        cache.truncate(torch.where(finished, start, start + 1 + acceptance.accepted.to(start.device)))
        rows_index = torch.arange(len(live), device=pending.device)
        pending = acceptance.tokens[rows_index, acceptance.accepted]
        drafter.observe(Verified(draft=draft, logits=out, accepted=acceptance.accepted, tokens=acceptance.tokens,
                                 hidden=hidden))
        yield stepped


def _emit(row: RowState, token: int, logprob: float, tokenizer: Tokenizer, cursor: Constraint | None) -> None:
    """Append one token to a row, advancing its constraint cursor (the plain loop's order)."""
    row.append(token, logprob, tokenizer)
    if cursor is not None:
        cursor.advance(token)
        if cursor.done() and not row.done:
            row.finish_reason = "stop"


def _checked(draft: Draft, limits: Sequence[int], device: torch.device) -> Draft:
    """Hold a drafter to its limits (a longer draft would overflow the cache or max_tokens)."""
    cap = torch.as_tensor(list(limits), dtype=torch.long, device=device)
    lengths = torch.minimum(draft.lengths.to(device), cap)
    k = int(lengths.max()) if lengths.numel() else 0
    probs = None if draft.probs is None else draft.probs[:, :k].to(device)
    return Draft(tokens=draft.tokens[:, :k].to(device), lengths=lengths, probs=probs)
