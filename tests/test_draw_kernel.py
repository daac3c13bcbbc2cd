"""The inverse-CDF draw in C (metaloom/models/kernels/draw.c) against PyTorch's cumsum +
searchsorted (`metaloom.sampling.counter.cdf_search`): the same token for every row, including
targets placed exactly on a running sum, at chunk edges, and rows the C side sums four at a
time and shares among threads."""

from __future__ import annotations

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import draw
from metaloom.models.kernels.draw import kernels
from metaloom.sampling import counter as C

K = kernels().kernels
pytestmark = pytest.mark.skipif(K is None, reason=f"no draw kernels: {kernels().reason}")


def exact_targets(probs: torch.Tensor, at: list[int]) -> torch.Tensor:
    """u per row so that u C[-1] lands on the running sum at index at[b] (or within a rounding of
    it): a draw that compares with >= instead of >, or sums in another order, picks a neighbour."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    return torch.stack([cdf[b, i] / cdf[b, -1] for b, i in enumerate(at)])


@pytest.mark.parametrize("rows,v", [(1, 7), (3, 255), (4, 256), (5, 257), (9, 1000), (16, 49152)])
def test_the_c_draw_is_pytorchs_token_for_every_row(rows, v):
    g = torch.Generator().manual_seed(rows * 1000 + v)
    logits = 4 * torch.randn(rows, v, generator=g)
    logits[:, ::7] = float("-inf")  # tokens of probability 0 are never drawn
    probs = torch.log_softmax(logits, -1).exp()
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    assert K.inverse_cdf(probs, u).tolist() == C.cdf_search(probs, u).tolist()
    edges = [min(v - 1, e) for e in (0, 255, 256, 511, v // 2, v - 2, v - 1)]
    for e in edges:
        at = [(e + 3 * b) % v for b in range(rows)]
        u = exact_targets(probs, at)
        for nudge in (0.0, 2.0 ** -52, -(2.0 ** -52)):
            un = (u * (1 + nudge)).clamp(0, 1 - 2 ** -53)
            assert K.inverse_cdf(probs, un).tolist() == C.cdf_search(probs, un).tolist(), (e, nudge)


def test_a_large_batch_shared_among_threads_draws_the_same_tokens_as_one_thread():
    g = torch.Generator().manual_seed(5)
    probs = torch.log_softmax(3 * torch.randn(18, 262144, generator=g), -1).exp()
    u = torch.rand(18, generator=g, dtype=torch.float64)
    expected = C.cdf_search(probs, u).tolist()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert K.inverse_cdf(probs, u).tolist() == expected
    finally:
        torch.set_num_threads(threads)


def test_rows_with_nothing_to_draw_get_the_last_index_and_others_are_untouched():
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.1, 0.2, 0.7]])
    u = torch.tensor([0.5, 0.75, 0.0, 0.2], dtype=torch.float64)
    assert K.inverse_cdf(probs, u).tolist() == [2, 1, 2, 1] == C.cdf_search(probs, u).tolist()
    nan = torch.tensor([[0.2, float("nan"), 0.8]])
    assert 0 <= int(K.inverse_cdf(nan, torch.tensor([0.9], dtype=torch.float64))[0]) < 3
    with pytest.raises(InvalidParameter, match="V >= 1"):
        K.inverse_cdf(torch.empty(2, 0), torch.zeros(2, dtype=torch.float64))


def test_inverse_cdf_with_the_c_search_gives_pytorchs_tokens_in_the_callers_shape():
    lp = torch.log_softmax(torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)), -1)
    u = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 0.99]], dtype=torch.float64)
    fast = C.inverse_cdf(lp, u, draw.search)
    assert fast.shape == (2, 3) and fast.tolist() == C.inverse_cdf(lp, u).tolist()
    assert draw.search(torch.empty(0, 5), torch.empty(0, dtype=torch.float64)) is None  # left to PyTorch


def test_the_decode_loop_draws_sampled_tokens_through_the_c_kernel(monkeypatch):
    """A sampled generation reaches the kernel (the decode loop passes it to the pipeline's draw)."""
    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams
    from metaloom.testing.tiny import tiny_llama

    calls = []
    real = type(K).inverse_cdf

    def spy(self, probs, u):
        calls.append(tuple(probs.shape))
        return real(self, probs, u)

    monkeypatch.setattr(type(K), "inverse_cdf", spy)
    gen = LocalGenerator(tiny_llama())
    params = SamplingParams(temperature=1.0, n=3, max_tokens=4, seed=1, ignore_eos=True)
    out = gen.generate([Request("abcd", params)], ledger=Ledger())
    assert len(out[0]) == 3 and calls and all(rows == 3 for rows, _ in calls)


@pytest.mark.parametrize("rows,v,k", [(1, 1, 1), (1, 5, 5), (2, 63, 8), (3, 64, 8), (4, 65, 8), (7, 1000, 16),
                                      (5, 49152, 8), (1, 151936, 64)])
def test_rows_topk_is_torchs_on_distinct_values(rows, v, k):
    g = torch.Generator().manual_seed(rows * 7 + v + k)
    x = torch.randn(rows, v, generator=g)
    x[0, -1] = 100.0  # the largest in the last entry (the last block, partly filled)
    x[-1, 0] = 99.0  # and the first (the same row when there is one)
    assert K.topk(x, k).tolist() == x.topk(k, dim=-1).indices.tolist()
    assert draw.topk(x, k).tolist() == x.topk(k, dim=-1).indices.tolist()


def test_rows_topk_breaks_ties_by_index_and_skips_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 2.0, 3.0, float("-inf")] + [0.0] * 70])
    assert K.topk(x, 4).tolist() == [[1, 2, 5, 4]]
    x[0, 70] = 5.0  # a later block: the scan looks inside only because 5 beats the 4th (1.0)
    assert K.topk(x, 4).tolist() == [[70, 1, 2, 5]]
    assert K.topk(torch.full((1, 3), float("-inf")), 2).tolist() == [[0, 1]]  # -inf entries fill what is left
    with pytest.raises(InvalidParameter, match="k"):
        K.topk(x, 0)


@pytest.mark.parametrize("shape", [(1, 49152), (9, 49152), (2, 5, 1000), (3, 1), (4, 65)])
def test_row_max_is_torchs_max_with_ties_in_index_order(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(-6, 7, shape, generator=g).float()  # a few values over many entries: the maximum is tied
    x.view(-1, shape[-1])[0, -1] = 50.0  # one row's maximum alone in its last entry
    x.view(-1, shape[-1])[-1].fill_(float("-inf"))  # a row of nothing but -inf: max's value -inf at index 0
    values, index = draw.row_max(x)
    best = x.max(dim=-1)
    assert torch.equal(values, best.values) and torch.equal(index, best.indices)
    assert index.dtype == torch.long and index.shape == shape[:-1]


def test_row_max_marks_a_row_holding_nan_as_max_does():
    x = torch.tensor([[1.0, float("nan"), 3.0, 2.0], [float("nan")] * 4, [0.5, 4.0, 4.0, -1.0]])
    values, index = draw.row_max(x)
    assert values[:2].isnan().all() and values[2] == 4.0  # every caller reads a NaN row as one nothing is drawn from
    assert index[2] == 1 and ((index >= 0) & (index < 4)).all()  # NaN rows: some index in range


def test_row_max_outside_the_kernel_is_torchs():
    x = torch.randn(3, 4, 100, dtype=torch.bfloat16)
    values, index = draw.row_max(x)
    assert torch.equal(values, x.max(dim=-1).values) and torch.equal(index, x.max(dim=-1).indices)


def test_row_max_finds_the_first_of_ties_across_lanes_and_a_nan_in_the_tail():
    # 70 entries: two passes of 32 in vectors, then 6 in the tail; the maximum 3.0 at 41 (second
    # pass, lane 1 of the second chain) and at 9 (first pass, the same lane): 9 must win, and a
    # later lane holding it first (index 2) wins over both
    x = torch.zeros(4, 70)
    x[0, [41, 9]] = 3.0
    x[1, [41, 9, 2]] = 3.0
    x[2, 66] = float("nan")  # a NaN only in the tail
    x[3, 5] = float("nan")  # and one only in the vectors
    values, index = K.row_max(x)
    assert index.tolist()[:2] == [9, 2] and values.tolist()[:2] == [3.0, 3.0]
    assert values[2:].isnan().all() and 0 <= int(index[2]) < 70
    x[2, 66], x[2, 68] = 0.0, 7.0  # the largest in the tail
    assert K.row_max(x)[1].tolist()[2] == 68
