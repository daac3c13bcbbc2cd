"""Penalties: pure batched functions over logits [B, V] and the tokens a row has seen.

Step 1 of the pipeline (`metaloom.sampling.pipeline`). Each returns new logits; inputs are
never mutated; a row whose parameter disables the penalty comes back unchanged. Histories are
[B, L] long, right-padded with -1, with the valid length of each row in ``lengths`` [B].
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
# DRY's longest counted match, as in text-generation-webui: bounds the work per step (the
# backward scan is O(history) per extra token of match) and the exponent; a repeat this long
# is already penalised by multiplier * base ** (50 - allowed_length)
DRY_MAX_MATCH = 50


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL (Keskar et al. 2019) as in transformers: for tokens already seen, divide positive
    logits by the penalty and multiply negative ones by it. seen [B, V] bool."""
    p = penalty[:, None]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def presence_frequency_penalty(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                               frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI: logit - frequency * count - presence * (count > 0). counts [B, V] of output tokens."""
    c = counts.to(logits.dtype)
    return logits - frequency[:, None] * c - presence[:, None] * (c > 0).to(logits.dtype)


def _at(history: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """history[b, positions[b, j]], with -1 where the position is outside the row."""
    inside = (positions >= 0) & (positions < history.shape[1])
    return torch.where(inside, history.gather(1, positions.clamp(0, history.shape[1] - 1)), -1)


def no_repeat_ngram(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Ban (-inf) every token that would complete an n-gram already in the row's history, as
    transformers' `NoRepeatNGramLogitsProcessor` does (fairseq's rule). size [B] long, 0 disables."""
    out = logits
    vocab = logits.shape[-1]
    for n in sorted(set(size.tolist()) - {0}):  # usually one size per batch
        if history.shape[1] < n:
            continue
        windows = history.unfold(1, n, 1)  # [B, W, n]: window w covers positions w .. w + n - 1
        starts = torch.arange(windows.shape[1], device=history.device)
        prefix = _at(history, lengths[:, None] - n + 1 + torch.arange(n - 1, device=history.device))  # [B, n-1]
        # a window counts only when its last token is inside the row (never the one being generated)
        match = (windows[..., :-1] == prefix[:, None]).all(-1) & (starts[None] + n - 1 < lengths[:, None])
        match &= (size == n)[:, None] & (lengths >= n)[:, None]
        spare = torch.full_like(windows[..., -1], vocab)  # unmatched windows ban a spare column
        banned = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        banned.scatter_(1, torch.where(match, windows[..., -1].clamp(0, vocab), spare), True)
        out = out.masked_fill(banned[:, :vocab], NEG_INF)
    return out


def dry(logits: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, breakers: torch.Tensor,
        multiplier: torch.Tensor, base: torch.Tensor, allowed_length: torch.Tensor, last_n: torch.Tensor) -> torch.Tensor:
    """DRY, "don't repeat yourself" (p-e-w, text-generation-webui PR 5677; also llama.cpp).

    If the history ends with a sequence of ``m`` tokens that occurred before and was followed
    there by token ``t``, then ``t`` would extend a repetition: its logit drops by
    ``multiplier * base ** (m - allowed_length)`` when ``m >= allowed_length`` (``m`` is the
    longest such match over earlier occurrences). Matches never cross a sequence-breaker token
    (breakers [B, V] bool); a breaker as the last token or as ``t`` is never penalised. Only the
    last ``last_n`` tokens are searched (-1: the whole history), and matches count up to
    `DRY_MAX_MATCH` tokens. multiplier 0 disables a row. A penalty that overflows float32
    removes the token (-inf).
    """
    b, width = history.shape
    if width < 2:
        return logits
    device = history.device
    pos = torch.arange(width, device=device).expand(b, width)  # [B, L]
    last_pos = lengths - 1
    last = _at(history, last_pos[:, None])  # [B, 1]
    start = torch.where(last_n > 0, (lengths - last_n).clamp(min=0), torch.zeros_like(lengths))[:, None]

    def breaker(tokens: torch.Tensor) -> torch.Tensor:
        return breakers.gather(1, tokens.clamp(min=0)) & (tokens >= 0)

    following = _at(history, pos + 1)  # the token after each position
    # candidate occurrences i of the last token: start <= i < last position, followed by a non-breaker
    active = (pos >= start) & (pos < last_pos[:, None]) & (history == last) & ~breaker(following)
    active &= ~breaker(last) & (multiplier > 0)[:, None]
    match = active.to(torch.long)
    for k in range(1, min(width, DRY_MAX_MATCH)):  # extend every candidate backwards one token at a time
        active = active & (pos - k >= start) & (_at(history, pos - k) == _at(history, last_pos[:, None] - k))
        active = active & ~breaker(_at(history, last_pos[:, None] - k))
        if not bool(active.any()):
            break
        match = match + active.to(torch.long)
    longest = torch.zeros(b, logits.shape[-1] + 1, dtype=torch.long, device=device)
    spare = logits.shape[-1]  # positions without a candidate write 0 into a spare column
    longest.scatter_reduce_(1, torch.where(match > 0, following, spare), match, reduce="amax")
    longest = longest[:, :-1].to(logits.dtype)
    exponent = longest - allowed_length[:, None].to(logits.dtype)
    penalty = multiplier[:, None] * torch.pow(base[:, None], exponent)
    return logits - torch.where(exponent >= 0, penalty, torch.zeros_like(penalty))
