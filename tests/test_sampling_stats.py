"""Statistics: sampling through each adapter draws from its analytic filtered distribution
(total variation within a bound derived from the sample size; `metaloom.testing.stats`).

The analytic distributions are written here in plain Python from each adapter's definition,
independently of the batched tensor code."""

import math

import pytest
import torch

from metaloom.sampling import SamplingParams, make_sampler
from metaloom.sampling import processors as P
from metaloom.sampling.state import SamplingState
from metaloom.testing.stats import assert_rejected, assert_samples_match

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
    tokens = sampler.draw(lp, torch.rand(4000, dtype=torch.float64, generator=g))
    assert_samples_match(torch.bincount(tokens, minlength=V), target)


# --- top-nσ: the exact kept set and distribution, draws, and wrong variants it rejects ----------
#
# The reference (Tang et al. 2024, Algorithm 1; llama.cpp's `llama_sampler_top_n_sigma_apply`):
# on the temperature-scaled logits y = z / T, keep the tokens with y_i >= max(y) - n * sigma(y),
# sigma the population standard deviation (divided by the count, as llama.cpp) of the finite
# entries (earlier masks leave -inf), then softmax over the kept set. Scaling by 1/T scales max
# and sigma alike, so the kept set does not depend on T; the probabilities do. (The authors'
# vLLM evaluation code divides by count - 1 (`torch.std`) and keeps y_i > threshold; over a real
# vocabulary sigma differs by a factor sqrt(V / (V - 1)) ~ 1 + 1e-5, over 8 tokens by 7%, and
# SIGMA_Z pins llama.cpp's convention.)
#
# SIGMA_Z is built so that each plausible mistake changes the distribution: at T = 1.5, n = 1 the
# threshold falls 0.18 (in y) below token 3 and 0.055 above token 4, and token 4 sits above the
# count - 1 threshold (by 0.01; float32 errors are ~1e-6). Under SIGMA_MASK sigma is that of the
# five allowed tokens and token 4 is kept by 0.082; counting the masked tokens, or applying the
# mask after top-nσ, would drop it.
SIGMA_Z = [2.0, 1.7, 1.3, 0.85, 0.5, -0.3, -1.0, -2.5]
SIGMA_T, SIGMA_N = 1.5, 1.0
SIGMA_MASK = [i not in (1, 3, 5) for i in range(8)]  # a constraint mask (tokens 1, 3, 5 disallowed)
SIGMA_DRAWS = 40000
# Bound. The draws (torch.multinomial on the pipeline's probabilities, as `Sampler.draw`) are
# i.i.d., so by Bretagnolle-Huber-Carol
# P(||p_hat - p||_1 >= eps) <= 2^K exp(-n eps^2 / 2) over the K kept tokens; at delta = 1e-6,
# TV(p_hat, p) <= sqrt(2 (K ln 2 + ln 1e6) / n) / 2 = 0.0144 for K = 4, n = 40000
# (`metaloom.testing.stats.tv_bound`). Tokens outside the kept set have probability 0, so a single
# draw of one fails the test outright. A wrong distribution q is rejected except with probability
# delta when it puts mass q_out >= ln(1e6) / n = 3.5e-4 outside the kept set, or when
# TV(q, p) > tv_bound(K) + tv_bound(|supp q|) (`metaloom.testing.stats.assert_rejected`).


def _sigma(values, ddof=0):
    finite = [v for v in values if v != NEG]
    mean = sum(finite) / len(finite)
    return math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - ddof))


def _scaled(z, t, mask):
    return [v / t if mask is None or mask[i] else NEG for i, v in enumerate(z)]


def top_n_sigma_probs(z, t, n, mask=None):
    """The reference: threshold on the temperature-scaled finite logits, population sigma."""
    y = _scaled(z, t, mask)
    threshold = max(y) - n * _sigma(y)
    return softmax(keep(y, [v >= threshold for v in y]))


def _shift_boundary(z, t, n, mask, by):
    """The reference's kept set with ``by`` more (or fewer) tokens, counted down the ranking."""
    y = _scaled(z, t, mask)
    size = sum(x > 0 for x in top_n_sigma_probs(z, t, n, mask)) + by
    ranked = by_prob(softmax(y))[:size]
    return softmax(keep(y, [i in ranked for i in range(len(y))]))


def _sigma_of_probs(z, t, n, mask):
    y = _scaled(z, t, mask)
    p = softmax(y)
    return softmax(keep(y, [x >= max(p) - n * _sigma(p) for x in p]))


def _unscaled_sigma(z, t, n, mask):
    y = _scaled(z, t, mask)
    threshold = max(y) - n * _sigma(_scaled(z, 1.0, mask))
    return softmax(keep(y, [v >= threshold for v in y]))


def _sample_sigma(z, t, n, mask):
    y = _scaled(z, t, mask)
    threshold = max(y) - n * _sigma(y, ddof=1)
    return softmax(keep(y, [v >= threshold for v in y]))


def _count_masked(z, t, n, mask):
    y = _scaled(z, t, mask)
    finite = [v for v in y if v != NEG]
    mean = sum(finite) / len(y)
    threshold = max(y) - n * math.sqrt(sum((v - mean) ** 2 for v in finite) / len(y))
    return softmax(keep(y, [v >= threshold for v in y]))


def _mask_after(z, t, n, mask):
    y_all = _scaled(z, t, None)
    threshold = max(y_all) - n * _sigma(y_all)
    return softmax(keep(_scaled(z, t, mask), [v >= threshold for v in y_all]))


SIGMA_WRONG = {  # name -> (rows it applies to, wrong distribution)
    "sigma of the probabilities (p >= p_max - n sigma_p)": ("both", _sigma_of_probs),
    "no temperature on the kept logits": ("both", lambda z, t, n, mask: top_n_sigma_probs(z, 1.0, n, mask)),
    "sigma of the unscaled logits against the scaled ones": ("unmasked", _unscaled_sigma),
    "sample sigma (count - 1)": ("unmasked", _sample_sigma),
    "one token too many": ("both", lambda z, t, n, mask: _shift_boundary(z, t, n, mask, 1)),
    "one token too few": ("both", lambda z, t, n, mask: _shift_boundary(z, t, n, mask, -1)),
    "sigma over the masked tokens too (mask applied after)": ("masked", _mask_after),
    "masked tokens counted in the mean and variance": ("masked", _count_masked),
}
SIGMA_ROWS = {"unmasked": None, "masked": SIGMA_MASK}


def _sigma_process(t=SIGMA_T):
    """Both rows (unmasked, masked) through the real pipeline, in one batch: [2, V] log-probs."""
    sampler = make_sampler([SamplingParams(temperature=t, top_n_sigma=SIGMA_N)] * 2, V)
    mask = torch.tensor([[True] * V, SIGMA_MASK])
    return sampler.process(torch.tensor([SIGMA_Z] * 2), sampler.start(), mask=mask)


def _counts(probs, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.multinomial(probs, SIGMA_DRAWS, replacement=True, generator=g), minlength=V)


def test_top_n_sigma_keeps_exactly_the_reference_set_at_any_temperature():
    kept = torch.tensor([[True] * 4 + [False] * 4, [True, False, True, False, True, False, False, False]])
    for t in (0.3, 1.0, SIGMA_T, 4.0):
        lp = _sigma_process(t)
        assert torch.equal(torch.isfinite(lp), kept), t  # the same set at every temperature
        for row, mask in enumerate(SIGMA_ROWS.values()):
            target = torch.tensor(top_n_sigma_probs(SIGMA_Z, t, SIGMA_N, mask), dtype=torch.float64)
            assert torch.equal(target > 0, kept[row]), (t, row)
            assert torch.allclose(lp[row].exp().double(), target, atol=1e-6), (t, row)


@pytest.mark.parametrize("row", range(2), ids=list(SIGMA_ROWS))
def test_top_n_sigma_draws_match_the_reference_distribution(row):
    target = torch.tensor(top_n_sigma_probs(SIGMA_Z, SIGMA_T, SIGMA_N, list(SIGMA_ROWS.values())[row]),
                          dtype=torch.float64)
    counts = _counts(_sigma_process()[row].exp(), seed=5)
    assert not counts[target == 0].any()  # never a token outside the kept set
    assert_samples_match(counts, target)  # TV within tv_bound(K, 40000) (0.0144 for K = 4)


@pytest.mark.parametrize(("name", "row"), [(name, row) for name, (rows, _) in SIGMA_WRONG.items()
                                           for row in SIGMA_ROWS if rows in ("both", row)])
def test_top_n_sigma_check_rejects_a_wrong_implementation(name, row):
    """Negative control: the distribution a plausible mistake gives is outside the bound, and
    40000 draws from it (same seed) fail the check the real pipeline passes."""
    mask = SIGMA_ROWS[row]
    target = torch.tensor(top_n_sigma_probs(SIGMA_Z, SIGMA_T, SIGMA_N, mask), dtype=torch.float64)
    wrong = torch.tensor(SIGMA_WRONG[name][1](SIGMA_Z, SIGMA_T, SIGMA_N, mask), dtype=torch.float64)
    assert_rejected(wrong, target, SIGMA_DRAWS)
    with pytest.raises(AssertionError):
        assert_samples_match(_counts(wrong, seed=5), target)


# --- mirostat v2: the exact step, and the controller's long-run target -------------------------
#
# The reference (Basu et al. 2021's v2, as llama.cpp's `llama_sampler_mirostat_v2_apply`): mu
# starts at 2 tau; each step takes p = softmax of the logits it sees (after temperature), removes
# the tokens whose surprise -log2 p exceeds mu (never the most likely one), renormalises to q,
# draws, and moves mu <- mu - eta * (-log2 q(token) - tau): the surprise in bits under the
# truncated, renormalised q. (The authors' repository measures it under the untruncated p.)


def mirostat_v2(z, mu):
    """q: the reference's truncated, renormalised distribution of logits ``z`` at bound ``mu``."""
    p = softmax(z)
    top = by_prob(p)[0]
    return softmax(keep(z, [i == top or -math.log2(x) <= mu for i, x in enumerate(p)]))


def mirostat_v2_mu(mu, q_token, tau, eta):
    return mu - eta * (-math.log2(q_token) - tau)


HALVES = [math.log(2.0 ** -k) for k in (1, 2, 3, 4, 5, 5)]  # p = 1/2 .. 1/32, 1/32: surprises 1, 2, 3, 4, 5, 5 bits


def _mirostat_sampler(rows, tau, eta, temperature=1.0):
    return make_sampler([SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, temperature=temperature)] * rows,
                        len(HALVES))


def test_mirostat_truncation_set_given_mu():
    mus = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]
    sampler = _mirostat_sampler(len(mus), tau=1.0, eta=0.1)
    lp = sampler.process(torch.tensor([HALVES] * len(mus)), SamplingState(mu=torch.tensor(mus)))
    kept = [int(torch.isfinite(row).sum()) for row in lp]
    assert kept == [1, 1, 2, 3, 4, 6]  # mu below the top's 1 bit still keeps the top token
    expected = {2: [2 / 3, 1 / 3], 3: [4 / 7, 2 / 7, 1 / 7], 4: [8 / 15, 4 / 15, 2 / 15, 1 / 15]}
    for row, mu in enumerate(mus):
        q = torch.tensor(mirostat_v2(HALVES, mu), dtype=torch.float64)
        assert torch.allclose(lp[row].exp().double(), q, atol=1e-6), mu
        if kept[row] in expected:
            assert torch.allclose(q[:kept[row]], torch.tensor(expected[kept[row]], dtype=torch.float64))
    # it sees the tempered logits (llama.cpp's chain: temperature, then mirostat): at T = 0.5,
    # p ∝ 4^-k, surprises 0.41, 2.41, 4.41, ... bits: mu 2 keeps one token, mu 3.5 two (three at T = 1)
    cold = _mirostat_sampler(2, tau=1.0, eta=0.1, temperature=0.5)
    lp = cold.process(torch.tensor([HALVES] * 2), SamplingState(mu=torch.tensor([2.0, 3.5])))
    assert [int(torch.isfinite(row).sum()) for row in lp] == [1, 2]
    for row, mu in enumerate([2.0, 3.5]):
        q = torch.tensor(mirostat_v2([v / 0.5 for v in HALVES], mu), dtype=torch.float64)
        assert torch.allclose(lp[row].exp().double(), q, atol=1e-6)


def test_mirostat_mu_update_is_bits_of_the_renormalised_distribution():
    tau, eta, mu = 1.0, 0.25, 2.5
    sampler = _mirostat_sampler(2, tau, eta)
    assert torch.allclose(sampler.start().mu, torch.tensor([2 * tau, 2 * tau]))  # llama.cpp's start
    state = SamplingState(mu=torch.tensor([mu, mu]))
    lp = sampler.process(torch.tensor([HALVES] * 2), state)  # keeps tokens 0, 1: q = 2/3, 1/3
    moved = sampler.advance(state, torch.tensor([0, 1]), lp).mu
    right = [mu - eta * (math.log2(3 / 2) - tau), mu - eta * (math.log2(3) - tau)]  # 2.6037, 2.3538
    assert torch.allclose(moved.double(), torch.tensor(right, dtype=torch.float64), atol=1e-6)
    wrong = {  # what the mistakes would give for the same two draws
        "surprise under the untruncated p": [mu - eta * (1 - tau), mu - eta * (2 - tau)],
        "surprise in nats": [mu - eta * (math.log(3 / 2) - tau), mu - eta * (math.log(3) - tau)],
        "update sign flipped": [mu + eta * (math.log2(3 / 2) - tau), mu + eta * (math.log2(3) - tau)],
        "no eta": [mu - (math.log2(3 / 2) - tau), mu - (math.log2(3) - tau)],
    }
    for name, values in wrong.items():
        assert all(abs(a - b) > 0.01 for a, b in zip(values, right, strict=True)), name


def test_mirostat_steps_match_the_reference_over_a_run():
    """40 steps on three rows (tau, eta, temperature differ), with the pipeline's own draws: each
    step's distribution and mu equal the reference's."""
    configs = [(1.5, 0.1, 1.0), (2.5, 0.3, 0.7), (0.8, 1.0, 1.3)]
    sampler = make_sampler([SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, temperature=t)
                            for tau, eta, t in configs], V)
    state, g = sampler.start(), torch.Generator().manual_seed(4)
    mus = [2 * tau for tau, _, _ in configs]
    sizes = set()
    for _ in range(40):
        lp = sampler.process(torch.tensor([Z] * len(configs)), state)
        tokens = sampler.draw(lp, torch.rand(len(configs), dtype=torch.float64, generator=g))
        state = sampler.advance(state, tokens, lp)
        for row, (tau, eta, t) in enumerate(configs):
            q = mirostat_v2([v / t for v in Z], mus[row])
            assert torch.allclose(lp[row].exp().double(), torch.tensor(q, dtype=torch.float64), atol=1e-5)
            mus[row] = mirostat_v2_mu(mus[row], q[int(tokens[row])], tau, eta)
            sizes.add(sum(x > 0 for x in q))
        assert torch.allclose(state.mu.double(), torch.tensor(mus, dtype=torch.float64), atol=1e-4)
    assert len(sizes) >= 4  # the runs visit several truncation sets


# The long-run target. Write s_t for the surprise (bits, measured here from the returned
# log-probs) of step t's draw. Summing the update over T steps gives, exactly,
#     (1/T) sum_t (s_t - tau) = (mu_0 - mu_T) / (eta T),
# so the mean surprise is tau up to (mu_0 - mu_T) / (eta T), and the bound follows from bounds on
# mu_T (on p = softmax(Z), no ties, eta <= 1, mu_0 = 2 tau):
# - mu_t >= tau always: a kept token other than a lone top one has -log2 p <= mu, and q >= p on
#   the kept set, so s_t <= max(mu_t, 0); if s_t > tau then mu_{t+1} >= mu_t - eta (mu_t - tau) >= tau.
# - above S* = max_i -log2 p_i nothing is removed, so there mu moves by i.i.d. steps
#   X = eta (tau - s), s ~ p, with mean eta (tau - H_2(p)) < 0 for tau < H_2(p) = 2.355 bits. Each
#   excursion above S* starts at most eta tau above max(S*, mu_0) (mu rises by <= eta tau a step),
#   and by Lundberg's inequality rises a further x with probability <= exp(-theta x), theta > 0
#   the root of E[exp(theta X)] = 1. With at most R T excursions over R rows and T steps,
#   mu_T <= U = max(S*, mu_0) + eta tau + ln(R T / delta) / theta for every row, with
#   probability >= 1 - delta.
# Averaged over the rows: mean surprise - tau lies in [(mu_0 - U) / (eta T), (mu_0 - tau) / (eta T)],
# here about [-0.027, +0.0072] for tau = 1.8, eta = 0.25, R = 16, T = 1000, delta = 1e-6 (the
# draws are not independent, so no sqrt(n) bound applies; this one shrinks as 1/T).
# A controller that does not drive mu this way misses the interval by far more (parametrised below).
MIRO_TAU, MIRO_ETA, MIRO_ROWS, MIRO_STEPS, MIRO_DELTA = 1.8, 0.25, 16, 1000, 1e-6


def _lundberg_theta(p, tau, eta):
    """The positive root of sum_i p_i exp(theta eta (tau - s_i)) = 1, s_i = -log2 p_i (bisection)."""
    s = [-math.log2(x) for x in p]

    def excess(theta):
        return sum(x * math.exp(theta * eta * (tau - si)) for x, si in zip(p, s, strict=True)) - 1

    lo, hi = 1e-9, 1.0
    while excess(hi) < 0:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return lo


def mirostat_mean_surprise_interval(z, tau, eta, rows, steps, delta):
    p = softmax(z)
    assert min(-math.log2(x) for x in p) < tau < entropy(p) / math.log(2) and 0 < eta <= 1
    mu0 = 2 * tau
    upper = max(max(-math.log2(x) for x in p), mu0) + eta * tau + math.log(rows * steps / delta) / _lundberg_theta(p, tau, eta)
    return (mu0 - upper) / (eta * steps), (mu0 - tau) / (eta * steps)


def _nats_update(mu, logprob, tau, eta_):
    return mu - eta_ * (-logprob - tau)


def _nats_truncation(logits, mu, enabled):
    surprise = -torch.log_softmax(logits, dim=-1)
    below_top = logits < logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill((surprise > mu[:, None]) & below_top & enabled[:, None], NEG)


MIRO_VARIANTS = {  # name -> replacements in `metaloom.sampling.processors` (what the pipeline calls)
    "reference": {},
    "update sign flipped": {"mirostat_update": lambda mu, lp, tau, eta_: mu + eta_ * (-lp / math.log(2) - tau)},
    "update in nats": {"mirostat_update": _nats_update},
    "nats throughout": {"mirostat_update": _nats_update, "mirostat": _nats_truncation},
    "mu never updated": {"mirostat_update": lambda mu, lp, tau, eta_: mu},
}


@pytest.fixture
def one_thread():
    """Thousands of steps on [16, 8] tensors: a second intra-op thread only adds contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("variant", MIRO_VARIANTS)
def test_mirostat_mean_surprise_converges_to_tau(monkeypatch, one_thread, variant):
    """The reference lands in the derived interval around tau; each broken controller (patched
    into the pipeline) misses it."""
    for name, fn in MIRO_VARIANTS[variant].items():
        monkeypatch.setattr(P, name, fn)
    lo, hi = mirostat_mean_surprise_interval(Z, MIRO_TAU, MIRO_ETA, MIRO_ROWS, MIRO_STEPS, MIRO_DELTA)
    assert -0.03 < lo < 0 < hi < 0.01
    sampler = make_sampler([SamplingParams(mirostat=2, mirostat_tau=MIRO_TAU, mirostat_eta=MIRO_ETA)] * MIRO_ROWS, V)
    state, g = sampler.start(), torch.Generator().manual_seed(0)
    logits = torch.tensor([Z] * MIRO_ROWS)
    total = torch.zeros(MIRO_ROWS, dtype=torch.float64)
    for _ in range(MIRO_STEPS):
        lp = sampler.process(logits, state)
        tokens = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        total -= lp.gather(1, tokens[:, None])[:, 0].double() / math.log(2)
        state = sampler.advance(state, tokens, lp)
    error = float(total.mean()) / MIRO_STEPS - MIRO_TAU
    slack = 1e-4  # float32 mu: ~1e-7 per step, over 1000 steps and divided by eta T
    inside = lo - slack <= error <= hi + slack
    assert inside == (variant == "reference"), f"{variant}: mean surprise - tau = {error:.4f}, interval [{lo:.4f}, {hi:.4f}]"
