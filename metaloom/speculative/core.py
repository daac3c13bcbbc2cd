"""Verification and acceptance: the maths of speculative decoding as pure functions.

A drafter proposes ``d_1 .. d_k`` after a row's pending token ``t_0``; the target model scores
``[t_0, d_1 .. d_k]`` in one forward, which gives the target distribution ``p_i`` of the token
after ``d_i`` (``p_0`` after ``t_0``). Then, for each row:

- greedy rows accept ``d_{i+1}`` while it equals ``argmax p_i``; the first mismatch is replaced
  by ``argmax p_i`` and, when every draft is accepted, ``argmax p_k`` is a bonus token. The
  output is exactly the plain greedy loop's.
- sampled rows accept ``d_{i+1}`` with probability ``min(1, p_i(d) / q_i(d))``; on the first
  rejection the replacement is drawn from ``norm(max(0, p_i - q_i))``, and when all are
  accepted a bonus token is drawn from ``p_k`` (Leviathan et al. 2023, "Fast inference from
  transformers via speculative decoding", Algorithm 1; Chen et al. 2023, "Accelerating large
  language model decoding with speculative sampling"). Every emitted token is then distributed
  exactly as under plain sampling from ``p``. A deterministic drafter (prompt lookup, Jacobi)
  has ``q`` = one-hot at its token, so acceptance is with probability ``p(d)`` and the residual
  is ``p`` with ``d`` removed.

``p`` is what the one logits pipeline returns (`Sampler.process`): penalties, bias, constraint
mask, temperature and truncation included, so speculation verifies against exactly the
distribution the plain loop draws from. `target_logprobs` walks the positions of a draft,
advancing the pipeline's `SamplingState` (and constraint cursors) through the drafted tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metaloom.constrain import Constraint, batch_mask
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
           draft_probs: torch.Tensor | None, greedy: torch.Tensor,
           generators: Sequence[torch.Generator | None], argmax: torch.Tensor | None = None) -> Acceptance:
    """Accept or reject each row's draft.

    target_logprobs [B, K+1, V]: log p_i (pipeline output; -inf where impossible).
    draft_tokens [B, K] long: row b's draft is ``draft_tokens[b, :draft_lengths[b]]``.
    draft_probs [B, K, V] or None: q_i, the distribution each draft token was drawn from
    (None: deterministic drafts, q = one-hot). greedy [B] bool: rows decoded by argmax.
    generators[b]: row b's RNG (None: torch's default) for the uniform and the final draw.
    argmax [B, K+1]: ``target_logprobs.argmax(-1)`` when the caller has it already.
    """
    b, k1, v = target_logprobs.shape
    k = k1 - 1
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft tokens {tuple(draft_tokens.shape)} do not match target positions {(b, k1)}")
    device = target_logprobs.device
    rows = torch.arange(b, device=device)
    lengths = draft_lengths.to(device)
    in_draft = torch.arange(k, device=device)[None, :] < lengths[:, None]  # [B, K]
    greedy = greedy.to(device)
    best = target_logprobs.argmax(dim=-1) if argmax is None else argmax  # [B, K+1]: the same argmax as Sampler.draw
    ok = (best[:, :k] == draft_tokens) & in_draft
    sampled = [r for r in range(b) if not bool(greedy[r])]
    p = q_n = None
    if sampled:
        p = target_logprobs.float().exp()
        p_d = p[:, :k].gather(2, draft_tokens[..., None])[..., 0]  # [B, K]
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(2, draft_tokens[..., None])[..., 0]
        u = _uniforms(generators, sampled, (k,), device)
        # accept with probability min(1, p/q): u < p/q, written without dividing by q
        ok = torch.where(greedy[:, None], ok, (u * q_d < p_d) & in_draft)
    accepted = ok.to(torch.long).cumprod(dim=1).sum(dim=1) if k else torch.zeros(b, dtype=torch.long, device=device)
    final = best[rows, accepted]
    if p is not None:
        p_n = p[rows, accepted]  # [B, V]
        rejected = accepted < lengths
        at = accepted.clamp(max=max(k - 1, 0))
        if k == 0:
            q_n = torch.zeros_like(p_n)
        elif draft_probs is None:
            q_n = torch.nn.functional.one_hot(draft_tokens[rows, at], v).to(p_n.dtype)
        else:
            q_n = draft_probs[rows, at].float()
        # after a rejection: norm(max(0, p - q)); all accepted: the bonus token from p
        residual = torch.where(rejected[:, None], (p_n - q_n).clamp(min=0), p_n)
        empty = residual.sum(dim=-1) <= 0  # p == q up to rounding: that rejection had probability ~0
        residual = torch.where(empty[:, None], p_n, residual)
        final = final.clone()
        for g, members in _by_generator(generators, sampled):
            index = torch.as_tensor(members, device=device)
            final[index] = torch.multinomial(residual[index], 1, generator=g)[:, 0].to(final.dtype)
    tokens = torch.zeros(b, k1, dtype=torch.long, device=device)
    tokens[:, :k] = draft_tokens
    tokens[rows, accepted] = final
    return Acceptance(accepted=accepted, tokens=tokens)


def _by_generator(generators: Sequence[torch.Generator | None],
                  rows: Sequence[int]) -> list[tuple[torch.Generator | None, list[int]]]:
    """Rows grouped by their RNG (the n samples of a request share one), in first-use order."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for r in rows:
        g = generators[r]
        groups.setdefault(id(g), (g, []))[1].append(r)
    return list(groups.values())


def _uniforms(generators: Sequence[torch.Generator | None], rows: Sequence[int], shape: tuple[int, ...],
              device: torch.device) -> torch.Tensor:
    """[B, *shape] uniforms in [0, 1); row r's from generators[r] (other rows: 0)."""
    out = torch.zeros(len(generators), *shape, device=device)
    for g, members in _by_generator(generators, rows):
        u = torch.rand(len(members), *shape, generator=g, device=g.device if g is not None else device)
        out[torch.as_tensor(members, device=device)] = u.to(device)
    return out


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
    rows = torch.arange(n.shape[0], device=n.device)
    picked = gather_states(states, n)
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
