"""Pure batched logits functions. Each takes logits [B, V] (float32) and per-row parameter
tensors [B] and returns new logits; inputs are never mutated. A disabled row (e.g. top_k 0,
top_p 1) comes back unchanged. Removed tokens get -inf.

Temperature lives here (the draw: `metaloom.sampling.counter`); penalties in `penalties.py`, truncation in
`truncation.py` (all re-exported, so ``processors.top_k`` etc. work). The order they run in
is documented once, in `metaloom.sampling.pipeline`.
"""

from __future__ import annotations

import torch

from metaloom.sampling.penalties import dry, no_repeat_ngram, presence_frequency_penalty, repetition_penalty
from metaloom.sampling.truncation import (
    entropy,
    epsilon,
    eta,
    min_p,
    mirostat,
    mirostat_update,
    top_h,
    top_k,
    top_n_sigma,
    top_p,
    typical,
    xtc,
)

NEG_INF = float("-inf")

__all__ = [
    "dry", "dynamic_temperature", "entropy", "epsilon", "eta", "min_p", "mirostat", "mirostat_update",
    "no_repeat_ngram", "presence_frequency_penalty", "repetition_penalty", "temperature", "top_h", "top_k",
    "top_n_sigma", "top_p", "typical", "xtc",
]


def temperature(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Divide by the temperature; t must be > 0 (greedy rows are handled by the pipeline)."""
    return logits / t[:, None]


def dynamic_temperature(logits: torch.Tensor, t: torch.Tensor, spread: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """Entropy-based dynamic temperature, as llama.cpp's dynatemp (kalomaze): the temperature
    runs from t - spread (a certain row) to t + spread (a uniform one) as
    (t - spread) + 2 * spread * (H / H_max) ** exponent, with H the entropy of softmax(logits)
    and H_max = log(number of finite logits). Rows with spread 0 are divided by t. A row whose
    temperature comes out 0 keeps only its most likely tokens (the limit of t -> 0)."""
    count = torch.isfinite(logits).sum(-1)
    h_max = torch.log(count.clamp(min=2).to(logits.dtype))
    normalised = (entropy(logits) / h_max).clamp(min=0.0)
    dyn = (t - spread) + 2 * spread * normalised.pow(exponent)
    dyn = torch.where((spread > 0) & (count > 1), dyn, t)
    safe = torch.where(dyn > 0, dyn, torch.ones_like(dyn))
    cold = logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values, NEG_INF)
    return torch.where((dyn > 0)[:, None], logits / safe[:, None], cold)


