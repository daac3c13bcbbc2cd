"""Hand-made vectors with exact expected results for the adapters transformers lacks (top-nσ,
dynamic temperature, XTC, mirostat, DRY), and invariants of every adapter."""

import math

import pytest
import torch

from metaloom.sampling import processors as P

INF = float("-inf")


def kept(logits: torch.Tensor) -> list[list[bool]]:
    return torch.isfinite(logits).tolist()


# ---- top-nσ (Tang et al. 2024)

def test_top_n_sigma_keeps_logits_within_n_std_of_the_max():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])  # mean 2, population std sqrt(2)
    assert kept(P.top_n_sigma(x, torch.tensor([1.0]))) == [[True, True, False, False, False]]  # >= 2.586
    assert kept(P.top_n_sigma(x, torch.tensor([2.0]))) == [[True, True, True, False, False]]  # >= 1.172
    assert torch.equal(P.top_n_sigma(x, torch.tensor([0.0])), x)  # 0 disables


def test_top_n_sigma_ignores_removed_tokens_and_temperature():
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, INF, INF]])
    assert kept(P.top_n_sigma(x, torch.tensor([1.0])))[0][:5] == [True, True, False, False, False]
    for t in (0.3, 2.0):
        assert kept(P.top_n_sigma(x / t, torch.tensor([1.5]))) == kept(P.top_n_sigma(x, torch.tensor([1.5])))


# ---- dynamic temperature (llama.cpp dynatemp)

def test_dynamic_temperature_maps_normalised_entropy_to_the_range():
    probs = torch.tensor([[0.5, 0.25, 0.25]])
    x = probs.log()
    h = 1.5 * math.log(2) / math.log(3)  # H / H_max
    for t, r, e in [(1.0, 0.5, 1.0), (0.8, 0.3, 2.0), (1.2, 1.2, 0.5)]:
        expected = (t - r) + 2 * r * h ** e
        out = P.dynamic_temperature(x, torch.tensor([t]), torch.tensor([r]), torch.tensor([e]))
        torch.testing.assert_close(out, x / expected, atol=1e-6, rtol=0)


def test_dynamic_temperature_extremes():
    uniform = torch.zeros(1, 4)
    out = P.dynamic_temperature(uniform + torch.tensor([[0.0, 1e-3, 0.0, 0.0]]), torch.tensor([1.0]),
                                torch.tensor([0.5]), torch.tensor([1.0]))
    torch.testing.assert_close(out[0, 1], torch.tensor(1e-3 / 1.5), atol=1e-6, rtol=1e-3)  # near-uniform: t + r
    # a certain row (entropy underflows to 0) with t - r = 0 keeps only its most likely token
    certain = torch.tensor([[200.0, 0.0, 0.0]])
    cold = P.dynamic_temperature(certain, torch.tensor([0.5]), torch.tensor([0.5]), torch.tensor([1.0]))
    assert cold.tolist() == [[200.0, INF, INF]]
    # spread 0 is plain temperature; one finite token is left alone
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, INF, INF]])
    out = P.dynamic_temperature(x, torch.tensor([2.0, 0.5]), torch.tensor([0.0, 0.5]), torch.tensor([1.0, 1.0]))
    assert out[0].tolist() == [0.5, 1.0, 1.5] and out[1].tolist() == [2.0, INF, INF]


# ---- XTC (exclude top choices)

def test_xtc_removes_all_top_choices_but_the_least_likely():
    x = torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]).log()
    assert kept(P.xtc(x, torch.tensor([0.15]), torch.tensor([True]))) == [[False, False, True, True, True]]
    assert torch.equal(P.xtc(x, torch.tensor([0.15]), torch.tensor([False])), x)  # coin says no
    assert torch.equal(P.xtc(x, torch.tensor([0.35]), torch.tensor([True])), x)  # one token above: no-op


def test_xtc_keeps_ties_at_the_lowest_top_probability():
    x = torch.tensor([[0.3, 0.3, 0.3, 0.1]]).log()
    assert torch.equal(P.xtc(x, torch.tensor([0.2]), torch.tensor([True])), x)
    y = torch.tensor([[0.4, 0.25, 0.25, 0.1]]).log()
    assert kept(P.xtc(y, torch.tensor([0.2]), torch.tensor([True]))) == [[False, True, True, True]]


# ---- mirostat v2

def test_mirostat_truncates_by_surprise_and_keeps_the_top():
    x = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()  # surprises 1, 2, 3, 3 bits
    on = torch.tensor([True])
    assert kept(P.mirostat(x, torch.tensor([2.5]), on)) == [[True, True, False, False]]
    assert kept(P.mirostat(x, torch.tensor([3.0]), on)) == [[True, True, True, True]]
    assert kept(P.mirostat(x, torch.tensor([0.5]), on)) == [[True, False, False, False]]
    assert torch.equal(P.mirostat(x, torch.tensor([0.5]), torch.tensor([False])), x)


def test_mirostat_update_moves_mu_by_the_surprise_error():
    lp = torch.tensor([math.log(1 / 3), math.log(0.5)])
    mu = P.mirostat_update(torch.tensor([2.5, 4.0]), lp, torch.tensor([1.25, 3.0]), torch.tensor([0.1, 0.5]))
    torch.testing.assert_close(mu, torch.tensor([2.5 - 0.1 * (math.log2(3) - 1.25), 4.0 - 0.5 * (1.0 - 3.0)]))


# ---- DRY

def _dry(history, breakers=(), multiplier=0.5, base=2.0, allowed=2, last_n=-1, vocab=10):
    h = torch.tensor([history])
    mask = torch.zeros(1, vocab, dtype=torch.bool)
    mask[0, list(breakers)] = True
    return P.dry(torch.zeros(1, vocab), h, torch.tensor([len(history)]), mask, torch.tensor([multiplier]),
                 torch.tensor([base]), torch.tensor([allowed]), torch.tensor([last_n]))[0]


def _penalties(out):
    return {i: -v for i, v in enumerate(out.tolist()) if v != 0}


def test_dry_penalises_the_token_that_extends_a_repeat():
    # "1 2 3" occurred before, followed by 4: match length 3 -> 0.5 * 2 ** (3 - 2)
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3])) == {4: 1.0}
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], allowed=3)) == {4: 0.5}
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], allowed=4)) == {}
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], base=1.75, multiplier=0.8, allowed=1)) == pytest.approx({4: 0.8 * 1.75 ** 2})


def test_dry_takes_the_longest_match_per_token():
    # 3 occurs twice before: after "5 3" (length 1, followed by 4) and after "1 2 3" (length 3, followed by 6)
    assert _penalties(_dry([5, 3, 4, 1, 2, 3, 6, 1, 2, 3])) == {6: 1.0}
    assert _penalties(_dry([5, 3, 4, 1, 2, 3, 6, 1, 2, 3], allowed=1)) == {4: 0.5, 6: 2.0}


def test_dry_sequence_breakers_and_window():
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], breakers=[2])) == {}  # the match stops at the breaker
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], breakers=[3])) == {}  # last token is a breaker
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], breakers=[4])) == {}  # the continuation is a breaker
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], last_n=6)) == {4: 0.5}  # window starts at the first 2
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], last_n=5)) == {}
    assert _penalties(_dry([1, 2, 3, 4, 1, 2, 3], multiplier=0.0)) == {}


def _dry_reference(history, breakers, multiplier, base, allowed):
    """p-e-w's loop from text-generation-webui (matches count up to 50 tokens)."""
    last = history[-1]
    if last in breakers:
        return {}
    lengths = {}
    for i in [i for i, t in enumerate(history[:-1]) if t == last]:
        nxt = history[i + 1]
        if nxt in breakers:
            continue
        m = 1
        while m < 50 and i - m >= 0 and history[i - m] == history[-(m + 1)] and history[-(m + 1)] not in breakers:
            m += 1
        lengths[nxt] = max(m, lengths.get(nxt, 0))
    return {t: multiplier * base ** (m - allowed) for t, m in lengths.items() if m >= allowed}


def test_dry_batched_matches_the_reference_loop_on_ragged_rows():
    g = torch.Generator().manual_seed(0)
    lens = [0, 1, 2, 7, 19, 30, 40, 70]
    rows = [torch.randint(0, 4, (n,), generator=g).tolist() for n in lens]
    rows[-1] = [1, 2] * 35  # a loop longer than the longest counted match
    history = torch.full((len(rows), 70), -1)
    for i, r in enumerate(rows):
        history[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    breakers = torch.zeros(len(rows), 6, dtype=torch.bool)
    breakers[::2, 3] = True
    mult, base, allowed = [0.8] * 8, [1.5] * 8, [1, 2, 2, 2, 3, 1, 2, 2]
    out = P.dry(torch.zeros(len(rows), 6), history, torch.tensor(lens), breakers, torch.tensor(mult),
                torch.tensor(base), torch.tensor(allowed), torch.full((len(rows),), -1))
    for i, r in enumerate(rows):
        expected = _dry_reference(r, {3} if i % 2 == 0 else set(), mult[i], base[i], allowed[i]) if r else {}
        assert _penalties(out[i]) == pytest.approx(expected, rel=1e-5), i


# ---- top-H (Potraghloo et al. 2025)

def test_top_h_at_one_keeps_every_token_even_the_least_likely():
    """top_h = 1 is allowed and bounds the kept entropy by the whole entropy: every token stays.
    The bound is inclusive (``<=``): the least likely token's running entropy sum is exactly H,
    so a strict ``<`` drops it."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.7, 0.1, 0.1, 0.1]])
    x = probs.log()
    assert kept(P.top_h(x, torch.tensor([1.0, 1.0]))) == [[True] * 4, [True] * 4]
    # terms -p log p: 0.347, 0.347, 0.260, 0.260 (H = 1.213); alpha 0.5 bounds the sum by 0.607
    assert kept(P.top_h(x[:1], torch.tensor([0.5]))) == [[True, False, False, False]]
    assert kept(P.top_h(x[:1], torch.tensor([0.8]))) == [[True, True, True, False]]  # 0.953 <= 0.970


def test_top_h_one_through_the_pipeline_keeps_the_distribution():
    from metaloom.sampling import SamplingParams, make_sampler

    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    sampler = make_sampler([SamplingParams(top_h=1.0)], 5)
    assert torch.equal(sampler.process(x), torch.log_softmax(x, -1))


# ---- invariants of every adapter

ROW_PARAMS = torch.tensor([0.3, 0.6, 0.9])
ADAPTERS = {  # name -> (function of (logits, per-row params [3]), argmax invariant, disabling value)
    "temperature": (lambda x, v: P.temperature(x, v + 0.2), True, None),
    "dynamic_temperature": (lambda x, v: P.dynamic_temperature(x, v + 0.5, v, v * 3), True, None),
    "top_n_sigma": (lambda x, v: P.top_n_sigma(x, v * 2), True, 0.0),
    "top_k": (lambda x, v: P.top_k(x, (v * 10).long()), True, 0),
    "top_p": (P.top_p, True, 1.0),
    "min_p": (P.min_p, True, 0.0),
    "typical": (P.typical, False, 1.0),
    "epsilon": (lambda x, v: P.epsilon(x, v / 10), True, 0.0),
    "eta": (lambda x, v: P.eta(x, v / 10), True, 0.0),
    "top_h": (P.top_h, True, 0.0),
    "xtc": (lambda x, v: P.xtc(x, v / 5, v > 0), False, 0.0),
    "mirostat": (lambda x, v: P.mirostat(x, v * 3, v > 0), True, 0.0),
}


@pytest.mark.parametrize("name", ADAPTERS)
def test_adapter_invariants(name):
    fn, argmax_invariant, off = ADAPTERS[name]
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :5] = INF  # an earlier step removed some tokens
    before = x.clone()
    out = fn(x, ROW_PARAMS)
    assert torch.equal(x, before), "input mutated"
    assert out.shape == x.shape and out.dtype == x.dtype
    assert bool(torch.isfinite(out).any(-1).all()), "a row lost every token"
    assert not bool(torch.isnan(out).any())
    assert bool((torch.isinf(x) <= torch.isinf(out)).all()), "a removed token came back"
    if argmax_invariant:
        assert torch.equal(out.argmax(-1), x.argmax(-1))
    if off is not None:
        assert torch.equal(fn(x, torch.full((3,), float(off))), x), "a disabled row changed"


def test_penalties_do_not_mutate_and_disable_per_row():
    x = torch.randn(2, 8)
    history = torch.tensor([[1, 2, 1, 2, 1], [1, 2, 1, 2, 1]])
    lengths = torch.tensor([5, 5])
    before = (x.clone(), history.clone())
    out = P.no_repeat_ngram(x, history, lengths, torch.tensor([2, 0]))
    assert torch.isinf(out[0, 2]) and torch.equal(out[1], x[1])
    out = P.dry(x, history, lengths, torch.zeros(2, 8, dtype=torch.bool), torch.tensor([1.0, 0.0]),
                torch.tensor([2.0, 2.0]), torch.tensor([2, 2]), torch.tensor([-1, -1]))
    assert out[0, 2] < x[0, 2] and torch.equal(out[1], x[1])
    assert torch.equal(x, before[0]) and torch.equal(history, before[1])
