"""Statistical checks with bounds derived from the sample size (no magic tolerances)."""

from __future__ import annotations

import math

import torch


def l1_deviation_bound(categories: int, samples: int, delta: float = 1e-6) -> float:
    """With probability >= 1 - delta, the empirical distribution of ``samples`` i.i.d. draws over
    ``categories`` outcomes is within this L1 distance of the true one (Bretagnolle-Huber-Carol:
    P(||p_hat - p||_1 >= eps) <= 2^K exp(-n eps^2 / 2))."""
    return math.sqrt(2 * (categories * math.log(2) + math.log(1 / delta)) / samples)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """TV distance between the empirical distribution of ``counts`` and ``probs`` (same shape)."""
    empirical = counts.double() / counts.sum()
    return 0.5 * float((empirical - probs.double()).abs().sum())


def assert_samples_match(counts: torch.Tensor, probs: torch.Tensor, delta: float = 1e-6) -> None:
    """Zero-probability outcomes must never appear; the rest must be within the TV bound."""
    impossible = probs == 0
    drawn_impossible = torch.nonzero(impossible & (counts > 0)).flatten().tolist()
    assert not drawn_impossible, f"drew impossible outcomes: {drawn_impossible}"
    support = int((~impossible).sum())
    bound = l1_deviation_bound(support, int(counts.sum()), delta) / 2
    tv = total_variation(counts, probs)
    assert tv <= bound, f"total variation {tv:.4f} exceeds the bound {bound:.4f} for n={int(counts.sum())}"
