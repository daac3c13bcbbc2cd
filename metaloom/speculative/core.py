"""Verification and acceptance: the maths of speculative decoding as pure functions.

A drafter proposes ``d_1 .. d_k`` after a row's pending token ``t_0``; the target model scores
``[t_0, d_1 .. d_k]`` in one forward, which gives the target distribution ``p_i`` of the token
after ``d_i`` (``p_0`` after ``t_0``). At every position the target's own token ``x_i`` is
what plain decoding would emit there: ``argmax p_i`` for greedy rows, and for sampled rows the
plain loop's draw, the inverse CDF of ``p_i`` at the row's uniform for that position (the
counter scheme, `metaloom.sampling.counter`: a hash of the row's key and the token's position).
A row accepts ``d_{i+1}`` while it equals ``x_i``; it then emits ``x`` at the first mismatch,
or ``x_k`` as a bonus when every draft was accepted.

The emitted tokens are plain decoding's, token for token, whatever was drafted: for greedy
rows (as in Leviathan et al. 2023), and for sampled rows too, since ``x_i`` is the very draw
plain sampling makes there and a draft only decides how many of them one forward confirms.
This is speculative sampling with the target's draw coupled to the row's random numbers, which
makes the output independent of the drafter (Daliri et al. 2024, "Coupling without
communication and drafter-invariant speculative decoding"): a seeded row gives the same tokens
in any batch, with any drafter, any draft length (the cost model's choice, which depends on
measured times) and with speculation off. A deterministic draft (prompt lookup, Token
Recycling, heads, Jacobi: ``q`` one-hot) is accepted with probability ``p_i(d)``, exactly as
under the rule of Leviathan et al. ("Fast inference from transformers via speculative
decoding", Algorithm 1; Chen et al. 2023); a draft model that samples draws its token at the
same uniform from its own ``q`` (the inverse CDF of ``q``), and is accepted when the two inverse
CDFs land on the same token: with probability ``sum_x min(p(x), q(x))`` when ``p`` and ``q``
order their mass alike, less than Leviathan's rule where they do not (the price of the
invariance; greedy rows and deterministic drafts pay nothing).

``p`` is what the one logits pipeline returns (`Sampler.process`): penalties, bias, constraint
mask, temperature and truncation included, so speculation verifies against exactly the
distribution the plain loop draws from. `target_logprobs` walks the positions of a draft,
advancing the pipeline's `SamplingState` (and constraint cursors) through the drafted tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from metaloom.constrain import Constraint, batch_mask
from metaloom.models.kernels import draw as c_draw
from metaloom.sampling.counter import inverse_cdf, uniforms
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState


@dataclass(frozen=True)
class Acceptance:
    """The outcome of one verification. Row ``b`` emits ``tokens[b, :accepted[b] + 1]``: its
    ``accepted[b]`` accepted draft tokens, then the replacement (after a rejection) or bonus
    (all accepted) token drawn from the target."""

    accepted: torch.Tensor  # [B] long, 0 .. lengths[b]
    tokens: torch.Tensor  # [B, K + 1] long (entries past accepted[b] + 1 are padding)

    def emitted(self, row: int) -> list[int]:
        return self.tokens[row, :int(self.accepted[row]) + 1].tolist()


def accept(target_logprobs: torch.Tensor, draft_tokens: torch.Tensor, draft_lengths: torch.Tensor,
           greedy: torch.Tensor, keys: np.ndarray | None, argmax: torch.Tensor | None = None) -> Acceptance:
    """Accept or reject each row's draft (see the module doc).

    target_logprobs [B, K+1, V]: log p_i (pipeline output; -inf where impossible).
    draft_tokens [B, K] long: row b's draft is ``draft_tokens[b, :draft_lengths[b]]``.
    greedy [B] bool: rows decoded by argmax.
    keys [B, 2] int64 on the host: each row's random key and the position of its next token
    (`metaloom.sampling.counter`; None when every row is greedy).
    argmax [B, K+1]: ``target_logprobs.argmax(-1)`` when the caller has it already.
    """
    b, k1, _ = target_logprobs.shape
    k = k1 - 1
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft tokens {tuple(draft_tokens.shape)} do not match target positions {(b, k1)}")
    device = target_logprobs.device
    lengths = draft_lengths.to(device)
    best = target_logprobs.argmax(dim=-1) if argmax is None else argmax  # [B, K+1]: the same argmax as Sampler.draw
    if keys is None and b and not all(greedy.tolist()):  # a host list: after a forward each tensor op is dear
        raise ValueError("sampled rows need their random keys (keys)")
    if keys is None and device.type == "cpu":
        return _greedy_walk(best, draft_tokens, lengths)
    rows = torch.arange(b, device=device)
    in_draft = torch.arange(k, device=device)[None, :] < lengths[:, None]  # [B, K]
    own = best if keys is None else torch.where(greedy.to(device)[:, None], best,
                                                plain_draws(target_logprobs, keys))
    ok = (own[:, :k] == draft_tokens) & in_draft
    accepted = ok.to(torch.long).cumprod(dim=1).sum(dim=1) if k else torch.zeros(b, dtype=torch.long, device=device)
    tokens = torch.zeros(b, k1, dtype=torch.long, device=device)
    tokens[:, :k] = draft_tokens
    tokens[rows, accepted] = own[rows, accepted]
    return Acceptance(accepted=accepted, tokens=tokens)


def greedy_kept(best: Sequence[int], draft: Sequence[int], limit: int) -> int:
    """The drafts a greedy row keeps: while draft i (of its first ``limit``) equals the argmax
    ``best[i]`` at its position; it reads positions 0 .. the count returned."""
    a = 0
    while a < limit and best[a] == draft[a]:
        a += 1
    return a


def _greedy_walk(best: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor) -> Acceptance:
    """`accept` for greedy rows on the host: the same walk and tokens as the tensor ops, from one
    copy of the argmax and the draft. A drafted step on a CPU reads its handful of tokens in a
    few microseconds this way, where each of the tensor ops' dozen small kernels costs tens
    (issue 47: a drafted SmolLM2 step spent about 2 ms beyond its forward)."""
    own, drafts, n = best.tolist(), draft_tokens.tolist(), lengths.tolist()
    accepted, tokens = [], []
    for row, draft, limit in zip(own, drafts, n, strict=True):
        a = greedy_kept(row, draft, limit)
        out = [*draft, 0]
        out[a] = row[a]
        accepted.append(a)
        tokens.append(out)
    return Acceptance(accepted=torch.tensor(accepted, dtype=torch.long),
                      tokens=torch.tensor(tokens, dtype=torch.long).view(len(own), best.shape[1]))


def plain_draws(logprobs: torch.Tensor, keys: np.ndarray, offsets: np.ndarray | None = None) -> torch.Tensor:
    """[B, T] plain sampling's draw at every position: the inverse CDF of ``logprobs[b, j]``
    [B, T, V] at the uniform of row b's key and position ``keys[b, 1] + offsets[b, j]``
    (default ``j``: a chain; a tree's block position j is at its depth). The uniforms are
    computed on the host, the draws in one batched call: no device wait."""
    b, t, v = logprobs.shape
    keys = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
    at = np.arange(t, dtype=np.int64)[None, :] if offsets is None else np.asarray(offsets, dtype=np.int64)
    u = uniforms(np.repeat(keys[:, :1], t, axis=1).reshape(-1), (keys[:, 1:] + at).reshape(-1))
    return inverse_cdf(logprobs.reshape(b * t, v), torch.from_numpy(u).to(logprobs.device), c_draw.search).view(b, t)


def target_logprobs(sampler: Sampler, logits: torch.Tensor, drafts: torch.Tensor, state: SamplingState,
                    generators: Sequence[torch.Generator | None], masks: Sequence[torch.Tensor | None] | None = None,
                    ) -> tuple[torch.Tensor, list[SamplingState]]:
    """The pipeline's distribution at every verified position.

    logits [B, K+1, V] (target, over ``[pending, d_1 .. d_K]``); drafts [B, K]. Position i is
    processed with the state advanced through ``d_1 .. d_i`` (penalties, DRY, mirostat see
    the drafted tokens as if they had been drawn) and with ``masks[i]`` [B, V] (constraint
    cursors advanced through the drafts; see `constraint_masks`). Rows whose draft is shorter
    than K get garbage past their draft; the acceptance never reads it.

    Returns (logprobs [B, K+1, V] float32, states) with ``states[i]`` the state before position
    i (K+1 entries): after acceptance, `after_step` picks each row's.
    """
    k1 = logits.shape[1]
    if sampler.plain and masks is None:  # every position the same map of its logits: one call
        return torch.log_softmax(logits.float(), dim=-1), [state] * k1
    out = []
    states = [state]
    for i in range(k1):
        mask = masks[i] if masks is not None else None
        lp = sampler.process(logits[:, i], states[i], mask=mask, generators=generators)
        out.append(lp)
        if i < k1 - 1:
            states.append(sampler.advance(states[i], drafts[:, i], lp))
    return torch.stack(out, dim=1), states


def after_step(sampler: Sampler, states: Sequence[SamplingState], logprobs: torch.Tensor,
               acceptance: Acceptance) -> SamplingState:
    """The pipeline state after each row emitted its tokens: row b takes ``states[n_b]`` (the
    state after its n_b accepted drafts) advanced by its final (replacement/bonus) token."""
    n = acceptance.accepted
    # one state at every position (a plain pipeline's: nothing it keeps changes along a draft) needs no gather
    picked = states[0] if all(s is states[0] for s in states) else gather_states(states, n)
    if picked.empty:  # nothing to advance (the gathers below cost a small model's step tens of microseconds)
        return picked
    rows = torch.arange(n.shape[0], device=n.device)
    final = acceptance.tokens[rows, n]
    return sampler.advance(picked, final, logprobs[rows, n])


def gather_states(states: Sequence[SamplingState], index: torch.Tensor) -> SamplingState:
    """Row b of the result is row b of ``states[index[b]]``. Fields that grow with each token
    (the ``history`` of DRY / n-gram blocking, right-padded with -1) are padded with -1 to the
    widest; every other field has the same shape in every state."""
    first = states[0]
    changes = {}
    for f in dataclasses.fields(first):
        values = [getattr(s, f.name) for s in states]
        if values[0] is None:
            continue
        if values[0].dim() >= 2 and len({v.shape[1] for v in values}) > 1:
            width = max(v.shape[1] for v in values)
            values = [torch.nn.functional.pad(v, (0, width - v.shape[1]), value=-1) for v in values]
        stacked = torch.stack(values)  # [S, B, ...]
        rows = torch.arange(stacked.shape[1], device=stacked.device)
        changes[f.name] = stacked[index.to(stacked.device), rows]
    return dataclasses.replace(first, **changes)


def constraint_masks(cursors: Sequence[Constraint | None], drafts: torch.Tensor, lengths: torch.Tensor,
                     vocab_size: int, device: torch.device) -> tuple[list[torch.Tensor | None], list[int]]:
    """Masks for every verified position of a draft, advancing each row's cursor through its
    drafted tokens (pipeline step 3 at each position).

    Stops advancing a row at its first draft token the grammar forbids (p is 0 there, so the
    draft is rejected at that position and later masks are never read). Returns ``masks``
    (K+1 entries of [B, V] bool or None) and, per row, how many tokens each cursor advanced:
    the caller rolls them back (`Constraint.rollback`) before emitting.
    """
    k = drafts.shape[1]
    advanced = [0] * len(cursors)
    alive = [c is not None for c in cursors]
    masks: list[torch.Tensor | None] = []
    for i in range(k + 1):
        mask = batch_mask([c if alive[b] else None for b, c in enumerate(cursors)], vocab_size, device)
        masks.append(mask)
        if i == k:
            break
        for b, c in enumerate(cursors):
            if c is None or not alive[b]:
                continue
            token = int(drafts[b, i])
            if i >= int(lengths[b]) or (mask is not None and not bool(mask[b, token])):
                alive[b] = False
                continue
            c.advance(token)
            advanced[b] += 1
    return masks, advanced
