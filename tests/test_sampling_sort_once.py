"""The truncation steps that rank tokens by probability share one sort (`truncation.truncate`):
the shared sort gives the same tensor bit for bit as the steps one at a time, and as the
functions before they shared it (kept here as the reference); and the sampler sorts once."""

from __future__ import annotations

import itertools

import pytest
import torch

from metaloom.sampling import SamplingParams, make_sampler
from metaloom.sampling import truncation as T

INF = float("-inf")
B, V = 8, 257
PARAMS = {  # per-row values, some rows disabled (0, 1 or 0 as each step takes it)
    "top_n_sigma": torch.tensor([0.0, 1.5, 3.0, 0.5, 2.0, 0.0, 1.0, 4.0]),
    "top_h": torch.tensor([0.0, 0.3, 0.9, 1.0, 0.6, 0.95, 0.0, 0.5]),
    "top_k": torch.tensor([0, 1, 5, 40, 257, 300, 17, 3]),
    "top_p": torch.tensor([1.0, 0.05, 0.5, 0.9, 0.99, 1.0, 0.3, 0.7]),
    "min_p": torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 0.05, 0.0, 0.2]),
    "typical_p": torch.tensor([1.0, 0.2, 0.5, 0.9, 0.95, 0.99, 0.7, 0.3]),
    "epsilon_cutoff": torch.tensor([0.0, 1e-4, 1e-3, 0.01, 0.05, 0.0, 3e-3, 0.2]),
    "eta_cutoff": torch.tensor([0.0, 1e-4, 1e-3, 0.01, 0.05, 0.0, 3e-3, 0.2]),
}
STEP = {s.field: s for s in T.STEPS}


def _logits(seed: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    if ties:  # many equal logits, so a step's cut falls inside a tie
        x = (x * 2).round() / 2
    x[0, :20] = INF  # an earlier step (a constraint) removed some tokens
    x[3, 100:] = INF
    return x


def one_at_a_time(x: torch.Tensor, fields: tuple[str, ...]) -> torch.Tensor:
    for name in fields:
        x = STEP[name].apply(x, PARAMS[name])
    return x


# every combination of the steps around the shared sort, and the others among them
RANKING = ("top_n_sigma", "top_h", "top_k", "top_p", "min_p")
SUBSETS = [c for r in range(1, len(RANKING) + 1) for c in itertools.combinations(RANKING, r)] + [
    tuple(PARAMS), ("top_p", "typical_p"), ("top_h", "typical_p", "min_p"), ("top_k", "min_p", "eta_cutoff"),
    ("top_h", "top_k", "epsilon_cutoff", "eta_cutoff")]
SUBSETS = [tuple(f for f in PARAMS if f in subset) for subset in SUBSETS]  # the pipeline's order


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_shared_sort_is_bit_for_bit_the_steps_one_at_a_time(seed: int, ties: bool) -> None:
    x = _logits(seed, ties)
    for fields in SUBSETS:  # every combination of enabled steps, in the pipeline's order
        shared = T.truncate(x, [(STEP[f], PARAMS[f]) for f in fields])
        assert torch.equal(shared, one_at_a_time(x, fields)), fields


# the four functions as they were before they shared a sort (unstable sort, softmax per step)
def old_top_h(logits, alpha):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = torch.special.entr(torch.softmax(sorted_logits, dim=-1)).cumsum(-1)
    keep = cum <= alpha[:, None] * cum[:, -1:]
    keep[:, 0] = True
    out = logits.masked_fill(torch.zeros_like(keep).scatter(-1, order, ~keep), INF)
    return torch.where((alpha > 0)[:, None], out, logits)


def old_top_p(logits, p):
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    remove = ((torch.cumsum(probs, dim=-1) - probs) >= p[:, None]) & (p < 1)[:, None]
    remove[:, 0] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), INF)


def old_min_p(logits, p):
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < p[:, None] * probs.max(dim=-1, keepdim=True).values, INF)


OLD = {"top_h": old_top_h, "top_k": T.top_k, "top_p": old_top_p, "min_p": old_min_p}


@pytest.mark.parametrize("seed", range(3))
def test_same_outputs_as_before_the_shared_sort(seed: int) -> None:
    """On continuous logits (no ties, where the old unstable sort could order tokens either
    way) the shared sort removes exactly the tokens the old functions removed."""
    x = _logits(seed, ties=False) * (1 + seed / 2)
    for r in range(1, 5):
        for fields in itertools.combinations(OLD, r):
            old = x
            for f in fields:
                old = OLD[f](old, PARAMS[f])
            assert torch.equal(T.truncate(x, [(STEP[f], PARAMS[f]) for f in fields]), old), fields


class Calls:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sort = self.topk = 0
        sort, topk = torch.sort, torch.topk

        def counted_sort(*a, **k):
            self.sort += 1
            return sort(*a, **k)

        def counted_topk(*a, **k):
            self.topk += 1
            return topk(*a, **k)

        monkeypatch.setattr(torch, "sort", counted_sort)
        monkeypatch.setattr(torch, "topk", counted_topk)


@pytest.mark.parametrize(("params", "sorts", "topks"), [
    # the four steps that rank by probability: one sort (they used to take 2 sorts and a topk)
    (SamplingParams(top_h=0.9, top_k=40, top_p=0.9, min_p=0.05), 1, 0),
    (SamplingParams(top_k=40, top_p=0.9), 1, 0),
    # typical ranks by its own key: its own sort, and the shared one
    (SamplingParams(top_k=40, top_p=0.9, min_p=0.05, typical_p=0.9), 2, 0),
    # top-k and min-p alone need no sort at all
    (SamplingParams(top_k=40, min_p=0.05), 0, 1),
    (SamplingParams(min_p=0.05, epsilon_cutoff=1e-3, eta_cutoff=1e-3), 0, 0),
])
def test_the_sampler_sorts_once(monkeypatch: pytest.MonkeyPatch, params: SamplingParams, sorts: int,
                                topks: int) -> None:
    sampler = make_sampler([params, SamplingParams(temperature=0.7)], V)
    x = _logits(0, ties=True)[:2]
    expected = sampler.process(x)
    calls = Calls(monkeypatch)
    assert torch.equal(sampler.process(x), expected)
    assert (calls.sort, calls.topk) == (sorts, topks)
