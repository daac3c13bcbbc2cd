"""Pure batched logits functions. Each takes logits [B, V] (float32) and per-row parameter
tensors [B] and returns new logits; inputs are never mutated. A disabled row (e.g. top_k 0,
top_p 1) comes back unchanged. Removed tokens get -inf.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


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


def temperature(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Divide by the temperature; t must be > 0 (greedy rows are handled by the pipeline)."""
    return logits / t[:, None]


def top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept, as in
    transformers); k = 0 keeps all."""
    vocab = logits.shape[-1]
    k_eff = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kth = torch.topk(logits, int(k_eff.max()), dim=-1).values.gather(-1, (k_eff - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sum reaches p; the most likely token is always kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    remove_sorted = before >= p[:, None]
    remove_sorted[:, 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def min_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Min-p (Nguyen et al. 2024): drop tokens whose probability is below p times the top
    token's probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, NEG_INF)


def categorical(logprobs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one index from a [V] row of log-probabilities."""
    return int(torch.multinomial(logprobs.exp(), 1, generator=generator).item())
