"""Choosing tokens from a forward's scores, for the decode loop (`metaloom.decode.batch`):
`draw` (one token per row, the plain step) and `verify` (a drafted block per row, the
speculative step). Both go through the one logits pipeline (`metaloom.sampling.pipeline`),
with each row's constraint mask as pipeline step 3.

A row can become impossible to continue: its grammar engine fails, or the pipeline leaves it
no token at all (a constraint whose allowed tokens the penalties all ban, a logit bias of
-inf on every token). Such a row gets an error message and draws nothing; the other rows of
the batch go on untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from metaloom.constrain import Constraint, batch_mask
from metaloom.decode import greedy_verify
from metaloom.errors import InvalidGrammar
from metaloom.models.kernels import draw as c_draw
from metaloom.sampling.counter import row_uniforms
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState
from metaloom.speculative.core import Acceptance, accept, after_step, constraint_masks, target_logprobs
from metaloom.speculative.drafter import Draft


def masks(cursors: Sequence[Constraint | None] | None, vocab: int, device: torch.device,
          errors: dict[int, str]) -> torch.Tensor | None:
    """The batch's constraint mask [B, V] (None: no row constrained). A row whose grammar
    engine fails gets ``errors[row]`` and is left unconstrained here (it will not draw)."""
    if cursors is None:
        return None
    live = [None if b in errors else c for b, c in enumerate(cursors)]
    try:
        return batch_mask(live, vocab, device)
    except InvalidGrammar:
        for b, c in enumerate(live):
            if c is None:
                continue
            try:
                batch_mask([c], vocab, device)
            except InvalidGrammar as exc:
                errors[b] = str(exc)
                live[b] = None
        return batch_mask(live, vocab, device)


def _why_empty(mask: torch.Tensor | None, row: int) -> str:
    if mask is not None and not bool(mask[row].any()):
        return "the constraint allows no token here"
    if mask is not None:
        return ("every token the constraint allows is excluded by the sampling pipeline "
                "(penalties such as no_repeat_ngram_size, or logit_bias)")
    return "every token is excluded by the sampling pipeline (penalties such as no_repeat_ngram_size, or logit_bias)"


def raw_logprobs(raw: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(raw)[token] along the last axis: raw [..., V], tokens [...] -> [...] float32.
    The same formula as the pipeline's (so a plain pipeline's log-probabilities can stand in
    for it bit for bit, and every decoder reports the same numbers)."""
    return torch.log_softmax(raw.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


def most_likely(raw: torch.Tensor, k: int) -> list[Any]:
    """The ``k`` most likely tokens of log_softmax(raw) along the last axis, as nested lists of
    (token id, log-probability) pairs, most likely first: raw [..., V] -> [..., k] pairs (the same
    raw distribution as `raw_logprobs`, so a chosen token's entry equals its reported value)."""
    values, ids = torch.log_softmax(raw.float(), dim=-1).topk(k, dim=-1)
    return _pairs(ids.tolist(), values.tolist())


def _pairs(ids: Any, values: Any) -> Any:
    if ids and isinstance(ids[0], list):
        return [_pairs(i, v) for i, v in zip(ids, values, strict=True)]
    return tuple(zip(ids, values, strict=True))


@dataclass(frozen=True)
class Drawn:
    """One token per row: ``tokens`` [B], the pipeline's log-probabilities [B, V] (for the state
    update), each token's raw model log-probability [B] and pipeline log-probability [B].
    ``errors``: rows known to have failed before the draw (their grammar engine); ``best`` [B],
    on the device: each row's largest log-probability, which is not above -inf (or is NaN) in
    the rows the pipeline left no token. Both kinds' entries are meaningless; `failures` names
    them all once ``best`` is on the host (read with the tokens)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    raw: torch.Tensor
    chosen: torch.Tensor
    errors: dict[int, str]
    best: torch.Tensor
    mask: torch.Tensor | None = None

    def failures(self, best: Sequence[float], skip: Sequence[bool] = ()) -> dict[int, str]:
        """Every row that could not draw, with why: ``errors`` and the rows whose ``best`` (as
        read back on the host) allows no token; finished rows (``skip``) are never failures."""
        out = {b: e for b, e in self.errors.items() if not (skip and skip[b])}
        for b, v in enumerate(best):
            if not v > float("-inf") and b not in out and not (skip and skip[b]):  # NaN too
                out[b] = "no token can be drawn: " + _why_empty(self.mask, b)
        return out


def draw(sampler: Sampler, state: SamplingState, raw: torch.Tensor, scores: torch.Tensor,
         cursors: Sequence[Constraint | None] | None, generators: Sequence[torch.Generator | None],
         keys: np.ndarray, skip: Sequence[bool] = ()) -> Drawn:
    """Draw one token per row from ``scores`` [B, V] (``raw`` [B, V]: the model's logits, for the
    reported log-probabilities). ``keys`` [B, 2] int64 on the host: each row's random key and
    how many tokens it has drawn (`metaloom.sampling.counter`); ``generators``: the rows' generators for
    the pipeline's own coins (XTC). Rows with ``skip[b]`` (finished) draw a placeholder.

    Nothing here waits for the device: which rows the pipeline left no token is known only when
    the caller reads the tokens back (`Drawn.failures`). Until then the step's kernels queue
    behind the forward's, and the host is free (on a GPU, a wait here would leave the device
    idle while the rest of the draw is launched). A dead row draws a meaningless token in range
    (an all -inf row's inverse CDF is clamped to the last id) and emits nothing."""
    errors: dict[int, str] = {}
    active = [c if not (skip and skip[b]) else None for b, c in enumerate(cursors)] if cursors is not None else None
    mask = masks(active, scores.shape[-1], scores.device, errors)
    lp = sampler.process(scores, state, mask=mask, generators=generators)
    values, argmax = c_draw.row_max(lp)
    u = None if sampler.all_greedy else row_uniforms(keys, lp.device)
    # greedy rows take the argmax row_max made (a fresh tensor of their own: no copy)
    tokens = argmax if sampler.all_greedy else sampler.draw(lp, u, argmax, c_draw.search)
    # a greedy row's token is its argmax, whose log-probability is the maximum row_max found
    chosen = values if sampler.all_greedy else lp.gather(-1, tokens[:, None])[:, 0]
    # where the pipeline is plain log-softmax of the model's own logits, the two agree
    same = raw is scores and sampler.plain and mask is None
    return Drawn(tokens, lp, chosen if same else raw_logprobs(raw, tokens), chosen, errors, values, mask)


@dataclass(frozen=True)
class Verified:
    """A speculative step's outcome: what each row emits (`Acceptance`), the pipeline's
    log-probabilities at every verified position [B, K+1, V], the state after the step, and the
    rows that could not go on (with why)."""

    acceptance: Acceptance
    # [B, K+1, V]; for greedy rows under the plain pipeline only the positions some row read
    # (`greedy_verify`): past them, none
    logprobs: torch.Tensor
    state: SamplingState
    errors: dict[int, str]
    # [B, K+1]: the log-probability of each position's emitted token when every row is greedy
    # (the position's maximum; past a row's emitted tokens, padding), else None
    chosen: torch.Tensor | None = None


def live_cursors(cursors: Sequence[Constraint | None], vocab: int, device: torch.device,
                 errors: dict[int, str]) -> list[Constraint | None]:
    """The cursors of rows whose constraint engine still works (a failing one is recorded in
    ``errors`` and its row is out of this step)."""
    masks(cursors, vocab, device, errors)
    return [None if b in errors else c for b, c in enumerate(cursors)]


def verify(sampler: Sampler, state: SamplingState, scores: torch.Tensor, draft: Draft,
           cursors: Sequence[Constraint | None] | None, generators: Sequence[torch.Generator | None],
           keys: np.ndarray | None = None) -> Verified:
    """Accept a prefix of each row's draft and draw one more token (exact: Leviathan et al.
    2023; see `metaloom.speculative.core`). ``scores`` [B, K+1, V] over ``[pending, draft]``;
    ``keys`` [B, 2] int64 on the host: each row's random key and the position of its next token,
    for plain sampling's draw at every position (`metaloom.sampling.counter`; needed only when
    some row samples); ``generators``: the pipeline's own coins (XTC)."""
    errors: dict[int, str] = {}
    if cursors is None and state.empty and greedy_verify.applies(scores, sampler.plain and sampler.all_greedy):
        fast = greedy_verify.greedy_verify(scores, draft)  # the log-softmax of the positions read only
        if fast is not None:
            taken, read, emitted = fast
            return Verified(taken, read, state, errors, emitted)
    vocab = scores.shape[-1]
    position_masks = None
    if cursors is not None:
        live = live_cursors(cursors, vocab, scores.device, errors)
        position_masks, advanced = constraint_masks(live, draft.tokens, draft.lengths, vocab, scores.device)
        for c, n in zip(live, advanced, strict=True):
            if c is not None and n:
                c.rollback(n)  # re-advanced token by token when the rows emit
    lp, states = target_logprobs(sampler, scores, draft.tokens, state, generators, position_masks)
    lengths = draft.lengths
    # a position that allows no token: draft no further than the position before it; at
    # position 0 the row cannot go on at all (one pass gives the argmax acceptance needs too).
    # Found on the host from one copy of the maxima: after a forward each small tensor op costs
    # a CPU tens of microseconds (issue 47)
    values, best = c_draw.row_max(lp)
    empty = [(b, i) for b, row in enumerate(values.tolist()) for i, v in enumerate(row) if not v > float("-inf")]
    if empty:
        lengths = lengths.clone()
    for b, i in empty:
        if i == 0:
            first = position_masks[0] if position_masks is not None else None
            errors.setdefault(b, "no token can be drawn: " + _why_empty(first, b))
        elif i <= int(lengths[b]):
            lengths[b] = min(int(lengths[b]), i - 1)
    argmax: torch.Tensor | None = best
    if errors:
        lp = lp.clone()
        for b in errors:
            lp[b] = 0.0
            lengths[b] = 0
        argmax = None
    acceptance = accept(lp, draft.tokens, lengths, sampler.greedy, None if sampler.all_greedy else keys, argmax)
    # greedy rows emit each position's argmax (an accepted draft token is one), whose
    # log-probability is the position's maximum: no gather needed
    chosen = values if sampler.all_greedy and not errors else None
    return Verified(acceptance, lp, after_step(sampler, states, lp, acceptance), errors, chosen)
