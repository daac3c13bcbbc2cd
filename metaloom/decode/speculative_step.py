"""The speculative step of the decode batch (`metaloom.decode.batch`): each row's drafter
proposes tokens after its pending token, one forward verifies ``[pending, draft]`` (a chain, or a
token tree under a tree attention mask), a prefix of each draft plus one token is accepted
(`select.verify`, `tree_verify.verify_tree`: exact for greedy and sampling), the tokens are
emitted and the cache rolled back past the rejected drafts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from metaloom.constrain import Constraint
from metaloom.decode.emitting import emit_verified, row_tops
from metaloom.decode.joining import Row, row_keys
from metaloom.decode.select import raw_logprobs, verify
from metaloom.decode.tree_verify import verify_tree
from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.forward import charged_forward_both
from metaloom.speculative.drafter import Draft
from metaloom.speculative.drafter import Verified as Observed

if TYPE_CHECKING:
    from metaloom.decode.batch import DecodeBatch

VERIFY_STEP = {"verify_steps": 1}


def speculative_step(batch: DecodeBatch, done: list[bool], ledgers: list[Ledger], rngs: list[torch.Generator | None],
                     cursors: list[Constraint | None] | None) -> list[Row]:
    """Draft, verify in one forward, accept, roll back (`metaloom.speculative`)."""
    assert batch.cache is not None and batch.sampler is not None and batch.state is not None
    assert batch.pending is not None and batch.drafter is not None and batch.speculative is not None
    # the cost model (`PlannedState`): steps it is sure not to draft in run as plain steps, without
    # the drafters' planning and observing, and are reported to it
    ahead, skipped = getattr(batch.drafter, "plain_ahead", None), getattr(batch.drafter, "skipped", None)
    live = sum(1 for d in done if not d)
    if ahead is not None and skipped is not None and ahead(live):
        began = time.perf_counter()
        stepped = batch.plain_step(done, ledgers, rngs, cursors, also=VERIFY_STEP)[0]
        skipped(time.perf_counter() - began, live)
        return stepped
    device = batch.pending.device
    host = getattr(batch.cache, "host_lengths", None)  # the paged cache's, without a tensor
    longest = int(host().max()) if host is not None else int(batch.cache.lengths.max())
    room = batch.cache.capacity - longest - 1  # never draft past the cache
    limits = [0 if d else max(0, min(batch.speculative.num_draft, room, row.state.max_tokens - len(row.state.tokens) - 1))
              for row, d in zip(batch.rows, done, strict=True)]
    proposed = batch.drafter.propose([row.context for row in batch.rows], limits, ledgers)
    needs_hidden = bool(getattr(batch.drafter, "needs_hidden", False))
    # an empty draft (the cost model chose 0) skips `_checked`'s tensor work: nothing to hold to its limits
    if proposed.tokens.shape[1] == 0:
        draft = proposed if proposed.tokens.device == device and proposed.parents is None and proposed.probs is None \
            else Draft(proposed.tokens.to(device), proposed.lengths.to(device))
    else:
        draft = _checked(proposed, limits, device)
        if proposed.parents is not None and _all_chains(proposed, limits):
            # a tree whose verified nodes form one path a row (Token Recycling's chain shape; a
            # tree the cost model cut to one node) takes the chain step: the same acceptance,
            # without the tree's masks, walks and slot keeping, which cost a drafted SmolLM2
            # step 0.45 ms more than the chain's (issue 47)
            draft = Draft(draft.tokens, draft.lengths, draft.probs)
    if draft.tokens.shape[1] == 0:  # nothing drafted: the plain step's cost
        return _undrafted_step(batch, draft, done, ledgers, rngs, cursors, needs_hidden)
    # the step's small bookkeeping as host lists where it can: right after a forward every torch
    # op starts with cold caches and costs a small model's step tens of microseconds (issue 47)
    tokens = torch.cat([batch.pending[:, None], draft.tokens], dim=1)  # [B, K+1]
    start = host().tolist() if host is not None else batch.cache.lengths.tolist()
    drafted = draft.lengths.tolist()
    # on the host, as the plain step's: the model reads it there (`charged_forward_both` moves it where it must)
    valid = torch.tensor([0 if d else 1 + n for d, n in zip(done, drafted, strict=True)], dtype=torch.long)
    if draft.parents is not None:
        return tree_step(batch, draft, tokens, start, valid, done, ledgers, rngs, cursors)
    raw, scores, hidden = charged_forward_both(batch.model, tokens, batch.cache, ledgers, valid=valid,
                                               hidden=needs_hidden)
    highs = batch.measure()  # the drafts' KV is held until the rejected ones are rolled back below
    live_cursors = None if cursors is None else [None if d else c for c, d in zip(cursors, done, strict=True)]
    out = verify(batch.sampler, batch.state, scores, draft, live_cursors, rngs, row_keys(batch.rows))
    acc = out.acceptance
    batch.state = out.state
    chosen = out.chosen if out.chosen is not None else \
        out.logprobs.gather(-1, acc.tokens.to(out.logprobs.device)[..., None])[..., 0]  # [B, K+1]
    same = _chosen_are_raw(batch, raw, scores, cursors, out.errors)
    emitted_lp = (chosen if same else raw_logprobs(raw, acc.tokens.to(raw.device))).tolist()
    chosen_lp = chosen.tolist()
    accepted = acc.accepted.tolist()
    emitted = [row[:a + 1] for row, a in zip(acc.tokens.tolist(), accepted, strict=True)]  # `Acceptance.emitted`'s
    positions = [list(range(len(e))) for e in emitted]
    stepped = emit_verified(batch.rows, batch.cursors, done, out.errors, emitted, positions, emitted_lp, chosen_lp,
                            row_tops(batch.rows, done, raw), draft, accepted, highs)
    # keep pending + accepted drafts; rows finished before this step keep nothing
    batch.cache.truncate([s if d else s + 1 + a for s, d, a in zip(start, done, accepted, strict=True)])
    batch.pending = torch.tensor([e[-1] for e in emitted], dtype=torch.long, device=device)  # each row's last
    batch.drafter.observe(Observed(draft=draft, logits=raw, accepted=acc.accepted, tokens=acc.tokens, hidden=hidden,
                                  pending=tokens[:, 0]))
    return stepped


def _undrafted_step(batch: DecodeBatch, draft: Draft, done: list[bool], ledgers: list[Ledger],
                    rngs: list[torch.Generator | None], cursors: list[Constraint | None] | None,
                    needs_hidden: bool) -> list[Row]:
    """A step no row drafted for: the plain step (`DecodeBatch.plain_step`: the same token each
    row's verify of an empty draft accepts, by the same draw), without verify's acceptance and
    rollback, which cost a zero-draft step about a fifth of a small model's plain step (issue
    47); the drafter still observes what the target said."""
    assert batch.pending is not None and batch.drafter is not None
    pending = batch.pending
    # still a step of the speculative decoder, with nothing drafted (`Usage.verify_steps`), charged with the token
    stepped, raw, hidden = batch.plain_step(done, ledgers, rngs, cursors, hidden=needs_hidden, also=VERIFY_STEP)
    assert batch.pending is not None
    batch.drafter.observe(Observed(draft=draft, logits=raw, accepted=torch.zeros_like(draft.lengths),
                                  tokens=batch.pending[:, None], hidden=hidden, pending=pending))
    return stepped


def tree_step(batch: DecodeBatch, draft: Draft, tokens: torch.Tensor, start: Sequence[int], valid: torch.Tensor,
              done: list[bool], ledgers: list[Ledger], rngs: list[torch.Generator | None],
              cursors: list[Constraint | None] | None) -> list[Row]:
    """`speculative_step` for token-tree drafts: one tree-masked verify forward, a path
    accepted per row (`metaloom.decode.tree_verify`), the path's KV kept where it was written
    and the rejected branches' slots let go (`PagedKVCache.keep_entries`)."""
    assert batch.cache is not None and batch.sampler is not None and batch.state is not None
    assert batch.drafter is not None and draft.parents is not None
    if not isinstance(batch.cache, PagedKVCache):
        raise UnsupportedModel(f"token trees need the native engine's paged KV cache, not {type(batch.cache).__name__}")
    masks = draft.tree_attention(tokens.shape[1])
    needs_hidden = bool(getattr(batch.drafter, "needs_hidden", False))
    raw, scores, hidden = charged_forward_both(batch.model, tokens, batch.cache, ledgers, valid=valid, tree=masks,
                                               hidden=needs_hidden)
    highs = batch.measure()
    live_cursors = None if cursors is None else [None if d else c for c, d in zip(cursors, done, strict=True)]
    out = verify_tree(batch.sampler, batch.state, scores, draft, live_cursors, rngs, row_keys(batch.rows))
    batch.state = out.state
    width = tokens.shape[1]
    at = torch.tensor([p + [0] * (width - len(p)) for p in out.positions], device=raw.device)  # [B, T]
    emitted = torch.tensor([t + [0] * (width - len(t)) for t in out.tokens], device=raw.device)
    rows_index = torch.arange(len(batch.rows), device=raw.device)[:, None]
    chosen = out.logprobs.to(raw.device)[rows_index, at].gather(-1, emitted[..., None])[..., 0]
    same = _chosen_are_raw(batch, raw, scores, cursors, out.errors)
    chosen_lp = chosen.tolist()
    emitted_lp = chosen_lp if same else raw_logprobs(raw[rows_index, at], emitted).tolist()
    stepped = emit_verified(batch.rows, batch.cursors, done, out.errors, out.tokens, out.positions, emitted_lp, chosen_lp,
                            row_tops(batch.rows, done, raw), draft, out.accepted, highs)
    for b in range(len(batch.rows)):  # keep the pending token and the accepted path; rows done before keep nothing
        s = int(start[b])
        keep = range(s) if done[b] else [*range(s), *(s + p for p in out.positions[b])]
        batch.cache.keep_entries(b, np.asarray(list(keep), dtype=np.int64))
    batch.pending = torch.tensor([t[-1] for t in out.tokens], device=batch.pending.device if batch.pending is not None
                                else raw.device)
    accepted = torch.tensor(out.accepted)
    flat = torch.tensor([t + [0] * (width - len(t)) for t in out.tokens])
    batch.drafter.observe(Observed(draft=draft, logits=raw, accepted=accepted, tokens=flat, hidden=hidden,
                                  pending=tokens[:, 0]))
    return stepped


def _chosen_are_raw(batch: DecodeBatch, raw: torch.Tensor, scores: torch.Tensor,
                    cursors: list[Constraint | None] | None, errors: dict[int, str]) -> bool:
    """Whether the pipeline's log-probabilities of the emitted tokens are the reported (raw)
    ones: a plain log-softmax of the model's own logits, no constraint, no failed row."""
    assert batch.sampler is not None
    return raw is scores and batch.sampler.plain and cursors is None and not errors


def _all_chains(draft: Draft, limits: Sequence[int]) -> bool:
    """Whether every row's tree, cut to its limit, is a chain: node i follows node i - 1 for each
    node verified. Read from the drafter's own tensors (made on the host: no device wait)."""
    assert draft.parents is not None
    return all(all(p == i - 1 for i, p in enumerate(row[:min(n, limit)]))
               for row, n, limit in zip(draft.parents.tolist(), draft.lengths.tolist(), limits, strict=True))


def _checked(draft: Draft, limits: Sequence[int], device: torch.device) -> Draft:
    """Hold a drafter to its limits (a longer draft would overflow the cache or max_tokens)."""
    held = [min(n, limit) for n, limit in zip(draft.lengths.tolist(), limits, strict=True)]  # host ints: no tensor ops
    lengths = torch.tensor(held, dtype=torch.long, device=device)
    k = max(held, default=0)
    probs = None if draft.probs is None else draft.probs[:, :k].to(device)
    parents = None if draft.parents is None else draft.parents[:, :k].to(device)  # a prefix of a tree is a tree
    if parents is not None and probs is not None:
        raise InvalidParameter("draft", "a sampled tree", "deterministic token trees (probs None)")
    return Draft(tokens=draft.tokens[:, :k].to(device), lengths=lengths, probs=probs, parents=parents)
