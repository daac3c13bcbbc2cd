"""Differential tests: each adapter transformers also has gives the same filtered distribution
as transformers' logits processor, on random logit batches (per row, with per-row parameters)."""

import pytest
import torch
from transformers.generation import logits_process as T

from metaloom.sampling import SamplingParams, make_sampler
from metaloom.sampling import processors as P

B, V = 6, 64  # V <= 100: transformers' top-H looks only at the 100 most likely tokens


def _logits(seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different tokens removed"
    torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(theirs, -1), atol=1e-6, rtol=0)


def _per_row(warper, values, logits, input_ids=None):
    """transformers' processor applied row by row, each with that row's parameter."""
    ids = input_ids if input_ids is not None else torch.zeros(B, 1, dtype=torch.long)
    return torch.cat([warper(v)(ids[i:i + 1], logits[i:i + 1].clone()) for i, v in enumerate(values)])


TRUNCATION = [
    # (our function, transformers' processor, per-row parameter values)
    (P.temperature, T.TemperatureLogitsWarper, [0.3, 0.7, 1.0, 1.5, 2.0, 0.9]),
    (P.top_k, T.TopKLogitsWarper, [1, 2, 5, 17, 40, 64]),
    (P.top_p, T.TopPLogitsWarper, [0.05, 0.3, 0.5, 0.8, 0.95, 0.99]),
    (P.min_p, T.MinPLogitsWarper, [0.01, 0.05, 0.1, 0.3, 0.6, 0.9]),
    (P.typical, T.TypicalLogitsWarper, [0.05, 0.2, 0.5, 0.8, 0.9, 0.99]),
    (P.epsilon, T.EpsilonLogitsWarper, [1e-4, 1e-3, 3e-3, 0.01, 0.05, 0.2]),
    (P.eta, T.EtaLogitsWarper, [1e-4, 1e-3, 3e-3, 0.01, 0.05, 0.2]),
    (P.top_h, lambda v: T.TopHLogitsWarper(top_h=v), [0.1, 0.3, 0.5, 0.7, 0.9, 0.97]),
]


@pytest.mark.parametrize(("ours", "theirs", "values"), TRUNCATION, ids=lambda x: getattr(x, "__name__", None))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_matches_transformers(ours, theirs, values, seed):
    logits = _logits(seed, scale=[1.0, 3.0, 6.0][seed])
    dtype = torch.long if ours is P.top_k else torch.float32
    out = ours(logits, torch.tensor(values, dtype=dtype))
    assert_same_distribution(out, _per_row(theirs, values, logits))


@pytest.mark.parametrize("seed", [0, 1])
def test_truncation_matches_transformers_after_earlier_removals(seed):
    """Chained steps see -inf from earlier ones; the adapters must agree there too."""
    logits = T.TopKLogitsWarper(20)(None, _logits(seed))
    for ours, theirs, values in TRUNCATION[2:]:
        out = ours(logits, torch.tensor(values))
        assert_same_distribution(out, _per_row(theirs, values, logits))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repetition_penalty_matches_transformers(seed):
    g = torch.Generator().manual_seed(seed)
    logits = _logits(seed)
    ids = torch.randint(0, V, (B, 12), generator=g)
    values = [0.5, 0.9, 1.1, 1.3, 2.0, 5.0]
    seen = torch.zeros(B, V, dtype=torch.bool).scatter(1, ids, True)
    out = P.repetition_penalty(logits, seen, torch.tensor(values))
    assert_same_distribution(out, _per_row(T.RepetitionPenaltyLogitsProcessor, values, logits, ids))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(size):
    g = torch.Generator().manual_seed(size)
    ids = torch.randint(0, 5, (B, 30), generator=g)  # a small alphabet so n-grams repeat
    logits = _logits(size)
    out = P.no_repeat_ngram(logits, ids, torch.full((B,), 30), torch.full((B,), size))
    theirs = T.NoRepeatNGramLogitsProcessor(size)(ids, logits.clone())
    assert_same_distribution(out, theirs)
    assert bool(torch.isinf(out).any())  # the test bans something


def test_no_repeat_ngram_ragged_rows_and_sizes_match_transformers_per_row():
    g = torch.Generator().manual_seed(7)
    lengths = [1, 2, 5, 9, 20, 30]
    sizes = [2, 2, 3, 0, 2, 4]
    history = torch.full((B, 30), -1)
    rows = [torch.randint(0, 4, (n,), generator=g) for n in lengths]
    for i, r in enumerate(rows):
        history[i, :len(r)] = r
    logits = _logits(3)
    out = P.no_repeat_ngram(logits, history, torch.tensor(lengths), torch.tensor(sizes))
    for i, (r, n) in enumerate(zip(rows, sizes, strict=True)):
        theirs = T.NoRepeatNGramLogitsProcessor(n)(r[None], logits[i:i + 1].clone()) if n else logits[i:i + 1]
        assert_same_distribution(out[i:i + 1], theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_whole_pipeline_matches_a_chain_of_transformers_processors(seed):
    """Our documented order is transformers' order for the adapters both have."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 8, (1, 16), generator=g)
    logits = _logits(seed)[:1]
    params = SamplingParams(temperature=0.8, top_h=0.95, top_k=30, top_p=0.95, min_p=0.01, typical_p=0.97,
                            epsilon_cutoff=1e-4, eta_cutoff=1e-4, repetition_penalty=1.3, no_repeat_ngram_size=2)
    sampler = make_sampler([params], V)
    ours = sampler.process(logits, sampler.start(prompt.tolist()))
    chain = T.LogitsProcessorList([
        T.RepetitionPenaltyLogitsProcessor(1.3), T.NoRepeatNGramLogitsProcessor(2), T.TemperatureLogitsWarper(0.8),
        T.TopHLogitsWarper(0.95), T.TopKLogitsWarper(30), T.TopPLogitsWarper(0.95), T.MinPLogitsWarper(0.01),
        T.TypicalLogitsWarper(0.97), T.EpsilonLogitsWarper(1e-4), T.EtaLogitsWarper(1e-4)])
    assert_same_distribution(ours, torch.log_softmax(chain(prompt, logits.clone()), -1))
