"""Statistical checks with bounds derived from the sample size (no magic tolerances)."""

from __future__ import annotations

import math

import torch


def l1_deviation_bound(categories: int, samples: int, delta: float = 1e-6) -> float:
    """With probability >= 1 - delta, the empirical distribution of ``samples`` i.i.d. draws over
    ``categories`` outcomes is within this L1 distance of the true one (Bretagnolle-Huber-Carol:
    P(||p_hat - p||_1 >= eps) <= 2^K exp(-n eps^2 / 2))."""
    return math.sqrt(2 * (categories * math.log(2) + math.log(1 / delta)) / samples)


def tv_bound(categories: int, samples: int, delta: float = 1e-6) -> float:
    """Half of `l1_deviation_bound`: the total-variation radius `assert_samples_match` allows."""
    return l1_deviation_bound(categories, samples, delta) / 2


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
    bound = tv_bound(support, int(counts.sum()), delta)
    tv = total_variation(counts, probs)
    assert tv <= bound, f"total variation {tv:.4f} exceeds the bound {bound:.4f} for n={int(counts.sum())}"


def assert_rejected(wrong: torch.Tensor, probs: torch.Tensor, samples: int, delta: float = 1e-6) -> None:
    """Negative control: ``samples`` i.i.d. draws from ``wrong`` fail `assert_samples_match`
    against ``probs`` except with probability <= delta. Either reason suffices:

    - ``wrong`` puts mass q on outcomes impossible under ``probs``: all draws avoid them with
      probability (1 - q)^n <= exp(-q n), which must be <= delta;
    - otherwise, with probability >= 1 - delta the empirical distribution of the draws is within
      r_wrong = `tv_bound` (support of ``wrong``) of ``wrong`` (the same Bretagnolle-Huber-Carol
      bound), so by the triangle inequality its TV from ``probs`` is at least
      TV(wrong, probs) - r_wrong; that exceeds the allowed radius r = `tv_bound` (support of
      ``probs``) when TV(wrong, probs) > r + r_wrong.
    """
    wrong, probs = wrong.double(), probs.double()
    outside = float(wrong[probs == 0].sum())
    if outside > 0 and -outside * samples <= math.log(delta):
        return
    gap = 0.5 * float((wrong - probs).abs().sum())
    needed = tv_bound(int((probs > 0).sum()), samples, delta) + tv_bound(int((wrong > 0).sum()), samples, delta)
    assert gap > needed, (f"a wrong distribution at TV {gap:.4f} (mass {outside:.2e} outside the support) is not "
                          f"reliably rejected by {samples} draws: needs TV > {needed:.4f}")
