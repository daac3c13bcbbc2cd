"""Statistics: sampling through each adapter draws from its analytic filtered distribution
(total variation within a bound derived from the sample size; `metaloom.testing.stats`).

The analytic distributions are written here in plain Python from each adapter's definition,
independently of the batched tensor code."""

import math

import pytest
import torch

from metaloom.sampling import SamplingParams, make_sampler
from metaloom.testing.stats import assert_samples_match

Z = [2.0, 1.6, 1.2, 0.7, 0.2, -0.4, -1.0, -2.0]
V = len(Z)
N = 10000
NEG = -math.inf


def softmax(z):
    top = max(z)
    e = [math.exp(v - top) if v != NEG else 0.0 for v in z]
    return [x / sum(e) for x in e]


def entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


def keep(z, kept):
    return [v if k else NEG for v, k in zip(z, kept, strict=True)]


def by_prob(p):
    return sorted(range(len(p)), key=lambda i: -p[i])


def top_n_sigma(z, n):
    mean = sum(z) / len(z)
    std = math.sqrt(sum((v - mean) ** 2 for v in z) / len(z))
    return keep(z, [v >= max(z) - n * std for v in z])


def top_p(z, mass):
    p, out, total = softmax(z), [False] * len(z), 0.0
    for i in by_prob(p):
        out[i] = total < mass
        total += p[i]
    return keep(z, out)


def typical(z, mass):
    p = softmax(z)
    h = entropy(p)
    order = sorted(range(len(p)), key=lambda i: abs(-math.log(p[i]) - h))
    out, total = [False] * len(z), 0.0
    for i in order:
        out[i] = True
        total += p[i]
        if total >= mass:
            break
    return keep(z, out)


def top_h(z, alpha):
    p = softmax(z)
    bound, total, out = alpha * entropy(p), 0.0, [False] * len(z)
    for rank, i in enumerate(by_prob(p)):
        total += -p[i] * math.log(p[i])
        out[i] = rank == 0 or total <= bound
    return keep(z, out)


def xtc(z, threshold):
    p = softmax(z)
    above = [x >= threshold for x in p]
    if sum(above) < 2:
        return z
    lowest = min(x for x, a in zip(p, above, strict=True) if a)
    return keep(z, [not (a and x > lowest) for x, a in zip(p, above, strict=True)])


def dynatemp(z, t, r, e):
    h = entropy(softmax(z)) / math.log(len(z))
    return [v / (t - r + 2 * r * h ** e) for v in z]


def penalise(z, seen, theta):
    return [(v / theta if v > 0 else v * theta) if i in seen else v for i, v in enumerate(z)]


def _eta_cut(p, eps):
    return min(eps, math.sqrt(eps) * math.exp(-entropy(p)))


CASES = {  # name -> (params, prompt, output tokens so far, analytic probabilities)
    "temperature": (SamplingParams(temperature=0.6), [], [], softmax([v / 0.6 for v in Z])),
    "dynatemp": (SamplingParams(temperature=1.0, dynatemp_range=0.5, dynatemp_exponent=1.0), [], [],
                 softmax(dynatemp(Z, 1.0, 0.5, 1.0))),
    "top_n_sigma": (SamplingParams(temperature=0.8, top_n_sigma=1.0), [], [],
                    softmax([v / 0.8 for v in top_n_sigma(Z, 1.0)])),
    "top_k": (SamplingParams(top_k=3), [], [], softmax(keep(Z, [i < 3 for i in range(V)]))),
    "top_p": (SamplingParams(top_p=0.6), [], [], softmax(top_p(Z, 0.6))),
    "min_p": (SamplingParams(min_p=0.3), [], [],
              softmax(keep(Z, [x >= 0.3 * max(softmax(Z)) for x in softmax(Z)]))),
    "typical": (SamplingParams(typical_p=0.5), [], [], softmax(typical(Z, 0.5))),
    "epsilon": (SamplingParams(epsilon_cutoff=0.05), [], [], softmax(keep(Z, [x >= 0.05 for x in softmax(Z)]))),
    "eta": (SamplingParams(eta_cutoff=0.05), [], [],
            softmax(keep(Z, [x >= _eta_cut(softmax(Z), 0.05) for x in softmax(Z)]))),
    "top_h": (SamplingParams(top_h=0.6), [], [], softmax(top_h(Z, 0.6))),
    "xtc": (SamplingParams(xtc_probability=0.5, xtc_threshold=0.15), [], [],
            [0.5 * a + 0.5 * b for a, b in zip(softmax(Z), softmax(xtc(Z, 0.15)), strict=True)]),
    "mirostat": (SamplingParams(mirostat=2, mirostat_tau=1.0), [], [],  # mu starts at 2 tau = 2 bits
                 softmax(keep(Z, [-math.log2(x) <= 2.0 for x in softmax(Z)]))),
    "repetition": (SamplingParams(repetition_penalty=1.5), [0, 3, 6], [], softmax(penalise(Z, {0, 3, 6}, 1.5))),
    "presence_frequency": (SamplingParams(presence_penalty=0.5, frequency_penalty=0.4), [2], [1, 1, 4],
                           softmax([v - (0.5 + 0.4 * c if c else 0.0) for v, c in zip(Z, [0, 2, 0, 0, 1, 0, 0, 0],
                                                                                       strict=True)])),
    # history 1 2 3 1 2: "1 2" was followed by 3, so 3 extends a repeat of length 2 = allowed: penalty 0.8 * 1.75**0
    "dry": (SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, dry_sequence_breakers=()),
            [1, 2, 3], [1, 2], softmax([v - (0.8 if i == 3 else 0.0) for i, v in enumerate(Z)])),
    "no_repeat_ngram": (SamplingParams(no_repeat_ngram_size=2), [1, 2, 5], [1], softmax(keep(Z, [i != 2 for i in range(V)]))),
    "logit_bias": (SamplingParams(logit_bias={7: 3.0, 0: -1.0}), [], [],
                   softmax([v + {7: 3.0, 0: -1.0}.get(i, 0.0) for i, v in enumerate(Z)])),
    "combined": (SamplingParams(temperature=0.7, top_k=5, min_p=0.1, repetition_penalty=1.3, logit_bias={4: 1.0}), [0], [],
                 None),
}


def _combined():
    z = penalise(Z, {0}, 1.3)
    z = [v + (1.0 if i == 4 else 0.0) for i, v in enumerate(z)]
    z = [v / 0.7 for v in z]
    kth = sorted(z, reverse=True)[4]
    z = keep(z, [v >= kth for v in z])
    p = softmax(z)
    return softmax(keep(z, [x >= 0.1 * max(p) for x in p]))


def _process(params, prompt, output, rows, seed):
    sampler = make_sampler([params] * rows, V)
    state = sampler.start([prompt] * rows)
    for token in output:  # tokens drawn earlier (counts, history)
        state = sampler.advance(state, torch.full((rows,), token), torch.zeros(rows, V))
    g = torch.Generator().manual_seed(seed)
    lp = sampler.process(torch.tensor([Z] * rows), state, generators=[g] * rows)
    return sampler, lp, g


@pytest.mark.parametrize("name", CASES)
def test_sampling_through_each_adapter_matches_its_analytic_distribution(name):
    params, prompt, output, probs = CASES[name]
    target = torch.tensor(_combined() if probs is None else probs, dtype=torch.float64)
    assert (target - torch.tensor(softmax(Z), dtype=torch.float64)).abs().max() > 0.02  # the adapter acts here
    _, lp, g = _process(params, prompt, output, N, seed=1)
    draws = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
    assert_samples_match(torch.bincount(draws, minlength=V), target)


@pytest.mark.parametrize("name", ["xtc", "typical", "combined"])
def test_sampler_draw_matches_the_analytic_distribution(name):
    """The same through `Sampler.draw` itself (one categorical draw per row)."""
    params, prompt, output, probs = CASES[name]
    target = torch.tensor(_combined() if probs is None else probs, dtype=torch.float64)
    sampler, lp, g = _process(params, prompt, output, 4000, seed=2)
    tokens = sampler.draw(lp, [g] * 4000)
    assert_samples_match(torch.bincount(tokens, minlength=V), target)


def test_mirostat_mu_tracks_the_target_surprise():
    """Over many steps the observed surprise averages to tau (the controller's fixed point)."""
    tau, rows, steps = 2.0, 2000, 60
    sampler = make_sampler([SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=0.2)] * rows, V)
    state, g = sampler.start(), torch.Generator().manual_seed(0)
    logits = torch.tensor([Z] * rows)
    surprise = []
    for step in range(steps):
        lp = sampler.process(logits, state)
        tokens = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        if step >= steps // 2:
            surprise.append(-lp.gather(1, tokens[:, None]).mean().item() / math.log(2))
        state = sampler.advance(state, tokens, lp)
    assert abs(sum(surprise) / len(surprise) - tau) < 0.05
