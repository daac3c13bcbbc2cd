"""Sampling parameters, each logits function on hand-made vectors, and the pipeline."""

import math

import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.sampling import SamplingParams, make_sampler
from metaloom.sampling import processors as P
from metaloom.sampling.counter import row_uniforms
from metaloom.testing.stats import assert_samples_match

INF = float("-inf")


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 1.5), ("top_p", 0.0), ("top_k", -1),
    ("min_p", 1.1), ("n", 0), ("max_tokens", -5), ("max_tokens", 0), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("stop", ("",)), ("n", 1.5), ("seed", "x"),
])
def test_invalid_parameters_name_the_parameter(field, value):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**{field: value})
    assert info.value.name == field
    assert field in str(info.value) and "allowed" in str(info.value)


def test_logit_bias_checked_against_vocabulary():
    with pytest.raises(InvalidParameter, match="logit_bias"):
        make_sampler([SamplingParams(logit_bias={100: 1.0})], vocab_size=10)


def test_from_openai_maps_fields():
    p = SamplingParams.from_openai({"temperature": 0.5, "top_p": 0.9, "max_tokens": 7, "stop": "\n", "n": 2,
                                    "logit_bias": {"3": -100}, "seed": 4, "messages": []})
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.n, dict(p.logit_bias), p.seed) == (
        0.5, 0.9, 7, ("\n",), 2, {3: -100.0}, 4)
    with pytest.raises(InvalidParameter, match="top_p"):
        SamplingParams.from_openai({"top_p": 2})


def test_temperature_divides():
    x = torch.tensor([[1.0, 2.0, 4.0]])
    assert torch.equal(P.temperature(x, torch.tensor([2.0])), torch.tensor([[0.5, 1.0, 2.0]]))


def test_top_k_keeps_k_largest_and_zero_disables():
    x = torch.tensor([[1.0, 5.0, 3.0, 4.0], [1.0, 5.0, 3.0, 4.0]])
    out = P.top_k(x, torch.tensor([2, 0]))
    assert torch.equal(out[0], torch.tensor([INF, 5.0, INF, 4.0]))
    assert torch.equal(out[1], x[1])


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log()
    # 0.5 < 0.8 so keep the second; 0.5 + 0.3 = 0.8 reaches p=0.8, stop there
    out = P.top_p(x, torch.tensor([0.8]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # p smaller than the top probability keeps only the top token
    assert torch.isfinite(P.top_p(x, torch.tensor([0.1]))).tolist() == [[True, False, False, False]]
    assert torch.equal(P.top_p(x, torch.tensor([1.0])), x)


def test_top_p_stops_at_the_token_whose_mass_reaches_p_exactly():
    """Masses exactly representable in float32 (softmax of their logs gives them back bit for
    bit): 0.5 + 0.25 reaches p = 0.75 exactly, so the nucleus is two tokens; a `>` for `>=`
    keeps three."""
    x = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    assert torch.softmax(x, -1).tolist() == [[0.5, 0.25, 0.125, 0.125]]
    assert torch.isfinite(P.top_p(x, torch.tensor([0.75]))).tolist() == [[True, True, False, False]]
    assert torch.isfinite(P.top_p(x, torch.tensor([0.875]))).tolist() == [[True, True, True, False]]
    assert torch.isfinite(P.top_p(x, torch.tensor([0.5]))).tolist() == [[True, False, False, False]]


def test_min_p_scales_with_top_probability():
    """A threshold relative to the top probability, not absolute: p = 0.3 of a top 0.4 is 0.12,
    which keeps 0.2 (an absolute 0.3 would not)."""
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    out = P.min_p(probs.log(), torch.tensor([0.3]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_repetition_penalty_ctrl_rule():
    x = torch.tensor([[2.0, -2.0, 2.0]])
    seen = torch.tensor([[True, True, False]])
    assert torch.equal(P.repetition_penalty(x, seen, torch.tensor([2.0])), torch.tensor([[1.0, -4.0, 2.0]]))


def test_presence_and_frequency_penalties():
    x = torch.zeros(1, 3)
    counts = torch.tensor([[0, 1, 3]])
    out = P.presence_frequency_penalty(x, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    assert torch.allclose(out, torch.tensor([[0.0, -0.75, -1.25]]))


def test_inputs_not_mutated():
    x = torch.randn(3, 10)
    before = x.clone()
    for fn, arg in [(P.top_k, torch.tensor([2, 3, 0])), (P.top_p, torch.tensor([0.5, 0.9, 1.0])),
                    (P.min_p, torch.tensor([0.1, 0.0, 0.5])), (P.temperature, torch.tensor([0.5, 1.0, 2.0]))]:
        fn(x, arg)
        assert torch.equal(x, before)


def test_pipeline_greedy_row_is_argmax_of_penalised_biased_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    sampler = make_sampler([SamplingParams(temperature=0, logit_bias={2: 5.0}),
                            SamplingParams(temperature=0)], vocab_size=3)
    tokens = sampler.draw(sampler.process(logits), torch.rand(2, dtype=torch.float64))
    assert tokens.tolist() == [2, 1]


def test_pipeline_order_penalty_before_temperature_before_truncation():
    # repetition penalty turns token 1 from best to worst, then top-k 1 keeps token 2
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    sampler = make_sampler([SamplingParams(temperature=0.5, top_k=1, repetition_penalty=4.0)], vocab_size=3)
    lp = sampler.process(logits, sampler.start([[1]]))
    assert torch.isfinite(lp).tolist() == [[False, False, True]]


def test_pipeline_returns_normalised_logprobs():
    sampler = make_sampler([SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)], vocab_size=50)
    lp = sampler.process(torch.randn(1, 50))
    assert math.isclose(float(lp.exp().sum()), 1.0, rel_tol=1e-5)


def _draw_counts(params, logits, n=20000, seed=0):
    sampler = make_sampler([params], vocab_size=logits.shape[-1])
    lp = sampler.process(logits[None])
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(lp[0].exp(), n, replacement=True, generator=g)
    # one-draw path must agree with the vectorised check above: spot-check it is a valid index
    assert 0 <= sampler.draw(lp, torch.rand(1, dtype=torch.float64, generator=g)).item() < logits.shape[-1]
    return torch.bincount(draws, minlength=logits.shape[-1])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.2),
])
def test_sampling_matches_analytic_filtered_distribution(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    probs = torch.softmax(logits / params.temperature, dim=-1)
    keep = torch.ones(6, dtype=torch.bool)
    order = probs.argsort(descending=True)
    if params.top_k:
        keep[order[params.top_k:]] = False
    if params.top_p < 1:
        before = torch.cumsum(probs[order], 0) - probs[order]
        keep[order[before >= params.top_p]] = False
    if params.min_p:
        keep &= probs >= params.min_p * probs.max()
    target = torch.where(keep, probs, torch.zeros_like(probs))
    target = target / target.sum()
    assert_samples_match(_draw_counts(params, logits), target)


def test_draw_uses_the_row_generator_reproducibly():
    sampler = make_sampler([SamplingParams(temperature=1.0)] * 2, vocab_size=100)
    lp = sampler.process(torch.zeros(2, 100))
    keys = np.array([[7, 3], [8, 3]])
    a = [sampler.draw(lp, row_uniforms(keys, 'cpu')).tolist() for _ in range(2)]
    assert a[0] == a[1]
    # a row's draw depends on its key and counter alone, not on the rows beside it
    assert sampler.select([1]).draw(lp[1:], row_uniforms(keys[1:], 'cpu')).tolist() == a[0][1:]
