"""The counter-based draw (`metaloom.sampling.counter`): the hash against an independent
32-bit reference, uniforms that are reproducible and batch-independent, the inverse-CDF draw
on hand-made distributions, and its distribution by a chi-squared test."""

from __future__ import annotations

import math

import numpy as np
import torch

from metaloom.sampling import counter as C
from metaloom.testing.stats import assert_samples_match


def _lowbias32(x: int) -> int:
    """The published mixer in plain 32-bit arithmetic (Python ints, masked after each product)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_on_the_whole_word_range():
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF, *range(12345, 12400)]
    got = C.mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [_lowbias32(x) for x in xs]


def test_mix32_is_a_bijection_on_a_block_of_words():
    x = torch.arange(1 << 16, dtype=torch.long) * 65599
    assert C.mix32(x & C.MASK32).unique().numel() == 1 << 16


def test_row_keys_fit_int64_and_differ_by_seed_and_sample():
    keys = {C.row_key(seed, sample) for seed in range(50) for sample in range(50)}
    assert len(keys) == 2500
    assert all(0 <= k < 1 << C.KEY_BITS for k in keys)
    assert C.row_key(7, 3) == C.row_key(7, 3)


def test_uniforms_are_a_function_of_key_and_counter_alone():
    keys = torch.tensor([C.row_key(1, i) for i in range(6)])
    counters = torch.tensor([0, 5, 9, 0, 1 << 40, 3])
    u = C.uniforms(keys, counters)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    perm = torch.tensor([4, 2, 0, 5, 1, 3])
    assert torch.equal(C.uniforms(keys[perm], counters[perm]), u[perm])  # another batch, same values
    assert torch.equal(C.uniforms(keys[2:3], counters[2:3]), u[2:3])
    assert len(set(u.tolist())) == 6
    # the host (numpy) and device (torch) forms give the same numbers
    assert C.uniforms(keys.numpy(), counters.numpy()).tolist() == u.tolist()


def test_uniforms_are_uniform_over_counters_and_keys():
    n, bins = 60000, 20
    for keys, counters in ((torch.full((n,), C.row_key(3, 0)), torch.arange(n)),  # one row, many steps
                           (torch.tensor([C.row_key(3, i) for i in range(n)]), torch.zeros(n, dtype=torch.long))):
        u = C.uniforms(keys, counters)
        counts = torch.bincount((u * bins).long(), minlength=bins).double()
        # Pearson's chi-squared with 19 degrees of freedom: P(stat > 60) < 1e-6 for uniform draws
        chi2 = float(((counts - n / bins) ** 2 / (n / bins)).sum())
        assert chi2 < 60, chi2
        # successive values are not correlated (lag-1 correlation ~ N(0, 1/n))
        x = u - u.mean()
        corr = float((x[1:] * x[:-1]).mean() / x.var())
        assert abs(corr) < 5 / math.sqrt(n)


def test_inverse_cdf_on_hand_made_rows():
    lp = torch.log(torch.tensor([[0.2, 0.0, 0.8]] * 5))
    u = torch.tensor([0.0, 0.1, 0.19999, 0.2, 0.99999], dtype=torch.float64)
    # C = [0.2, 0.2, 1.0]: the first index with C > u; index 1 (probability 0) is never drawn
    assert C.inverse_cdf(lp, u).tolist() == [0, 0, 0, 2, 2]
    one = torch.log(torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    assert C.inverse_cdf(one, torch.tensor([0.0])).tolist() == [2]
    assert C.inverse_cdf(one, torch.tensor([1 - 2 ** -53], dtype=torch.float64)).tolist() == [2]


def test_inverse_cdf_draws_match_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.0625, 0.0625], dtype=torch.float64)
    n = 20000
    lp = torch.log(probs.float())[None].expand(n, -1)
    keys = np.array([(C.row_key(11, i), 4) for i in range(n)])
    tokens = C.inverse_cdf(lp, C.row_uniforms(keys, "cpu"))
    assert int((tokens == 3).sum()) == 0
    assert_samples_match(torch.bincount(tokens, minlength=6), probs)


def test_seeded_samples_do_not_depend_on_the_batch(smollm_generator):
    """A seeded sample is the same tokens alone, beside other requests, and as one of more
    samples: its draws are keyed by its seed, its index and its position only."""
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams

    def run(*requests):
        return [[c.token_ids for c in out] for out in smollm_generator.generate(list(requests), ledger=Ledger())]

    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    alone = run(Request("Tell me a story.", params))[0]
    beside = run(Request("What is 2 + 2?", SamplingParams(n=2, temperature=0.7, seed=1, max_tokens=9)),
                 Request("Tell me a story.", params))[1]
    more = run(Request("Tell me a story.", SamplingParams(n=5, temperature=1.0, seed=5, max_tokens=12,
                                                         ignore_eos=True)))[0]
    assert alone == beside == more[:3]
    assert len({tuple(t) for t in more}) == 5  # the samples differ from each other
