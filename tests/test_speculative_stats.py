"""Speculative sampling follows the target's distribution over whole sequences, with drafts
that are accepted often and rejected mid-draft.

Setting: a first-order Markov target over 4 tokens and a draft model that is a perturbed copy
of it (it also puts a little mass on tokens the target forbids), `DraftModelDrafter` with
``num_draft = 3``, 5 generated tokens after the prompt "a". The exact distribution of the
5-token sequence is the product of the target's next-token probabilities *as processed by the
sampling pipeline* (temperature, then top-k, then top-p; `metaloom.sampling.pipeline`), computed
here independently in float64. Thousands of speculative samples (one request, ``n = N``) are
compared with it by Pearson's chi-square goodness-of-fit test and by total variation against a
bound from n; plain sampling through the same generator API is the control, and a two-sample
chi-square test checks that speculative and plain samples are indistinguishable. Negative
controls show the test has power: the distributions a broken acceptance rule would produce
(drafts always accepted; verification against the unprocessed target) fail it at the same n.
A drafter that misreports its q changes nothing (the verification never reads q).

Only the public API is used (`LocalGenerator`, `Speculative`, `DraftModelDrafter`, `Ledger`,
and for the lying drafter the `Drafter` seam, `Draft`), so the test does not depend on how the
decode loop is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger, Usage
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.speculative import Draft, Speculative
from metaloom.speculative.drafters.draft_model import DraftModelDrafter
from metaloom.testing.stats import assert_samples_match, l1_deviation_bound, total_variation
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

V = 4  # vocabulary: "a" "b" "c" "d"
L = 5  # generated tokens per sample: V ** L = 1024 sequences, a few hundred of them possible
K = 3  # num_draft
N = 4000  # samples per run (the engine's per-row Python dominates the runtime)
DELTA = 1e-6  # false-alarm probability of every statistical assertion below
PROMPT = "a"  # token 0
PROMPT_TOKEN = 0

# Target next-token probabilities, row = previous token. Rows 0-2 forbid one token each (the
# draft does not, so it proposes impossible tokens that must always be rejected); row 3 has
# full support, so top-k = 3 truncates the target too.
TARGET_PROBS = torch.tensor([[0.10, 0.55, 0.35, 0.00],
                             [0.45, 0.00, 0.25, 0.30],
                             [0.00, 0.30, 0.20, 0.50],
                             [0.55, 0.25, 0.05, 0.15]], dtype=torch.float64)
TARGET_LOGITS = TARGET_PROBS.log().float()  # -inf where forbidden


def _draft_logits() -> torch.Tensor:
    """The target with its forbidden tokens given 5% and Gaussian noise (std 0.4) on every logit."""
    probs = TARGET_PROBS.clone()
    probs[probs == 0] = 0.05
    noise = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (probs.log() + 0.4 * noise).float()


DRAFT_LOGITS = _draft_logits()


@dataclass(frozen=True)
class Case:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def params(self, n: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, n=n, seed=seed,
                              max_tokens=L, ignore_eos=True)


CASES = {
    "temperature 1": Case(),
    # truncation bites: top-k drops the draft's 4th token in every row and the target's in row 3;
    # top-p drops the target's least likely remaining token in some rows
    "temperature 0.7, top-k 3, top-p 0.9": Case(temperature=0.7, top_k=3, top_p=0.9),
}


# --- the exact distributions -------------------------------------------------------------------


def _processed(logits: torch.Tensor, case: Case, margin: float = 1e-3) -> torch.Tensor:
    """Next-token probabilities [V, V] (row = previous token) after the pipeline's temperature ->
    top-k -> top-p, in float64, written independently of `metaloom.sampling`. Asserts that no
    truncation decision is within ``margin`` of its threshold, so float32 rounding in the
    engine cannot flip one."""
    x = logits.double() / case.temperature
    rows = []
    for row in x:
        keep = torch.isfinite(row)
        if case.top_k:
            values = torch.sort(row[keep], descending=True).values
            if case.top_k < len(values):
                kth, next_ = float(values[case.top_k - 1]), float(values[case.top_k])
                assert kth - next_ > margin, "top-k tie: the analytic distribution would be fragile"
                keep &= row >= kth
        probs = torch.softmax(row.masked_fill(~keep, -math.inf), dim=-1)
        if case.top_p < 1:
            order = torch.argsort(probs, descending=True)
            before = torch.cumsum(probs[order], dim=0) - probs[order]  # mass strictly before each token
            live = probs[order] > 0
            assert bool(((before - case.top_p).abs()[live] > margin).all()), "top-p boundary too close to call"
            drop = (before >= case.top_p) & live
            drop[0] = False  # the most likely token is always kept
            keep[order[drop]] = False
            probs = torch.softmax(row.masked_fill(~keep, -math.inf), dim=-1)
        rows.append(probs)
    return torch.stack(rows)


def _joint(first: torch.Tensor, rows: torch.Tensor, length: int = L) -> torch.Tensor:
    """P(x_1 .. x_length) = first[x_1] * prod_t rows[x_(t-1), x_t], flattened with x_1 the most
    significant base-V digit (as `_counts` encodes a sequence); ``rows`` is [V, V] or one [V, V]
    table per position ([length - 1, V, V])."""
    steps = rows if rows.dim() == 3 else rows.expand(length - 1, V, V)
    joint = first.double()
    for step in steps:
        joint = joint.unsqueeze(-1) * step.double()  # [..., prev, next] = joint[..., prev] * P[prev, next]
    return joint.flatten()


def _target_joint(case: Case) -> torch.Tensor:
    p = _processed(TARGET_LOGITS, case)
    return _joint(p[PROMPT_TOKEN], p)


def _acceptance_bounds(case: Case) -> tuple[float, float]:
    """Per drafted token, P(accept | previous token) = sum_x min(p(x), q(x)) (Leviathan et al.
    2023, Thm 3.5): its least and greatest value over previous tokens."""
    alpha = torch.minimum(_processed(TARGET_LOGITS, case), _processed(DRAFT_LOGITS, case)).sum(-1)
    return float(alpha.min()), float(alpha.max())


# --- statistics ----------------------------------------------------------------------------------


def _chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


def _chi2_critical(df: int, alpha: float = DELTA) -> float:
    """The x with P(chi-square(df) >= x) = alpha, by bisection."""
    lo, hi = 0.0, float(df)
    while _chi2_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


def _bins(expected: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Bin id per outcome for a chi-square test: outcomes with expected count >= 5 keep a bin
    each, the possible ones below 5 share one pooled bin (merged with the smallest kept bin if
    it still expects < 5), impossible outcomes get -1. Returns (ids, number of bins)."""
    ids = torch.full(expected.shape, -1, dtype=torch.long)
    big = torch.nonzero(expected >= 5).flatten()
    small = (expected > 0) & (expected < 5)
    ids[big] = torch.arange(len(big))
    count = len(big)
    if bool(small.any()):
        if float(expected[small].sum()) >= 5:
            ids[small] = count
            count += 1
        else:
            ids[small] = int(ids[big[expected[big].argmin()]])
    return ids, count


def _binned(values: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    keep = ids >= 0
    return torch.zeros(count, dtype=torch.float64).index_add_(0, ids[keep], values[keep].double())


def _chi2_gof(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's goodness-of-fit statistic of ``counts`` against ``probs`` and its degrees of
    freedom (bins - 1). Under the null it is asymptotically chi-square(df) (expected counts >= 5
    per bin, the usual rule); an outcome of probability 0 that was drawn fails outright."""
    drawn_impossible = torch.nonzero((probs == 0) & (counts > 0)).flatten().tolist()
    assert not drawn_impossible, f"drew impossible sequences: {drawn_impossible}"
    n = int(counts.sum())
    ids, count = _bins(n * probs)
    observed, expected = _binned(counts, ids, count), _binned(n * probs, ids, count)
    return float(((observed - expected) ** 2 / expected).sum()), count - 1


def _chi2_homogeneity(a: torch.Tensor, b: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's two-sample statistic: are counts ``a`` and ``b`` draws from one distribution?
    Bins as in `_chi2_gof`, chosen from the exact ``probs`` at the smaller sample size (so the
    binning does not depend on the data); under the null it is asymptotically chi-square(bins - 1)."""
    na, nb = int(a.sum()), int(b.sum())
    ids, count = _bins(min(na, nb) * probs)
    oa, ob = _binned(a, ids, count), _binned(b, ids, count)
    pooled = (oa + ob) / (na + nb)
    ea, eb = na * pooled, nb * pooled
    return float(((oa - ea) ** 2 / ea).sum() + ((ob - eb) ** 2 / eb).sum()), count - 1


# --- running the engine --------------------------------------------------------------------------


def _generator(speculative: Speculative | None = None) -> LocalGenerator:
    loaded = LoadedModel(model=MarkovModel(TARGET_LOGITS), tokenizer=CharTokenizer(V), name="toy", folder="",
                         dtype=torch.float32)
    return LocalGenerator(loaded, speculative=speculative)


def _sample(speculative: Speculative | None, case: Case, seed: int, n: int = N) -> tuple[torch.Tensor, Usage]:
    """Counts [V ** L] of the generated sequences of one request with n samples, and the usage."""
    ledger = Ledger()
    out = _generator(speculative).generate([Request(PROMPT, case.params(n, seed))], ledger=ledger)[0]
    assert len(out) == n
    return _counts([c.token_ids for c in out]), ledger.usage


def _counts(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    seqs = torch.tensor([list(s) for s in sequences], dtype=torch.long)
    assert seqs.shape[1] == L
    codes = (seqs * (V ** torch.arange(L - 1, -1, -1))).sum(-1)
    return torch.bincount(codes, minlength=V ** L)


def _draft_spec() -> Speculative:
    return Speculative(DraftModelDrafter(MarkovModel(DRAFT_LOGITS)), num_draft=K)


# --- tests ---------------------------------------------------------------------------------------


def test_chi_square_critical_values_match_the_tables():
    # the helper against printed tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4)
    assert _chi2_critical(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert _chi2_critical(10, 0.01) == pytest.approx(23.209, abs=1e-3)
    assert _chi2_critical(100, 0.001) == pytest.approx(149.449, abs=1e-3)


def test_the_truncated_case_truncates_target_and_draft():
    case = CASES["temperature 0.7, top-k 3, top-p 0.9"]
    p, q = _processed(TARGET_LOGITS, case), _processed(DRAFT_LOGITS, case)
    assert int((p[3] == 0).sum()) == 1  # top-k 3 drops a token from the target's full-support row
    assert int((p[0] == 0).sum()) == 2  # top-p drops the least likely allowed token of row 0
    assert bool(((q > 0).sum(-1) <= 3).all())  # top-k 3 drops a token from every draft row (4 allowed)
    assert float((p - torch.softmax(TARGET_LOGITS.double(), -1)).abs().max()) > 0.1  # far from the raw target


@pytest.mark.parametrize("name", sorted(CASES))
def test_speculative_sequences_follow_the_exact_target_distribution(name):
    case = CASES[name]
    exact = _target_joint(case)
    assert float(exact.sum()) == pytest.approx(1.0, abs=1e-12)
    support = int((exact > 0).sum())
    assert 20 <= support <= 400  # few enough outcomes for thousands of samples to pin them down

    spec_counts, usage = _sample(_draft_spec(), case, seed=1)
    plain_counts, plain_usage = _sample(None, case, seed=2)  # another seed: independent of the speculative run

    # The drafts are accepted often, multi-token drafts are accepted and rejected mid-draft.
    # Range for accepted / drafted (K = 3): in a step drafting k <= K tokens, token j is kept
    # iff tokens 1..j pass, each with probability alpha(prev) in [a_min, a_max] (see
    # `_acceptance_bounds`), so E[kept in the step | past] lies in [sum_{j<=k} a_min^j, k a_max]
    # and, as (1/k) sum_{j<=k} a_min^j falls with k, in [k m, k a_max] with
    # m = (a_min + a_min^2 + a_min^3) / 3. Kept-per-step minus its conditional mean is a
    # martingale difference confined, given the past, to an interval of width k <= K (kept is in
    # [0, k]); by Azuma-Hoeffding, with S verify steps,
    # |accepted - sum of the means| <= K sqrt(S ln(2/DELTA) / 2) except with probability DELTA.
    a_min, a_max = _acceptance_bounds(case)
    m = sum(a_min ** j for j in range(1, K + 1)) / K
    assert usage.drafted_tokens > 0 and usage.verify_steps > 0
    assert usage.accepted_tokens + usage.rejected_tokens == usage.drafted_tokens
    slack = K * math.sqrt(usage.verify_steps * math.log(2 / DELTA) / 2) / usage.drafted_tokens
    rate = usage.accepted_tokens / usage.drafted_tokens
    assert max(0.6, m - slack) < rate < min(1.0, a_max + slack), (rate, m, a_max, slack)
    assert usage.rejected_tokens > 0  # rejections, so residual draws happen
    assert usage.accepted_tokens / usage.verify_steps > 1  # on average more than one draft token kept per step
    assert usage.output_tokens == plain_usage.output_tokens == N * L
    assert plain_usage.drafted_tokens == 0

    # Goodness of fit. Pearson's X^2 over bins with expected count >= 5 is asymptotically
    # chi-square(bins - 1) under the null; reject beyond the 1 - DELTA quantile.
    for label, counts in (("speculative", spec_counts), ("plain", plain_counts)):
        stat, df = _chi2_gof(counts, exact)
        crit = _chi2_critical(df)
        assert stat < crit, f"{label}: X^2 = {stat:.1f} >= {crit:.1f} (df {df}, n {N})"
        # Non-asymptotic check: Bretagnolle-Huber-Carol, P(||p_hat - p||_1 >= eps) <= 2^S exp(-n eps^2 / 2)
        # over the S possible sequences, so TV = ||.||_1 / 2 <= sqrt(2 (S ln 2 + ln(1/DELTA)) / n) / 2
        # except with probability DELTA (`metaloom.testing.stats`).
        assert_samples_match(counts, exact, DELTA)

    # Speculative and plain samples are indistinguishable: the two-sample X^2 over the same bins,
    # and the TV between the two empirical distributions, at most the sum of the two
    # one-sample bounds at DELTA / 2 each (triangle inequality, union bound).
    stat, df = _chi2_homogeneity(spec_counts, plain_counts, exact)
    crit = _chi2_critical(df)
    assert stat < crit, f"speculative vs plain: X^2 = {stat:.1f} >= {crit:.1f} (df {df})"
    tv = total_variation(spec_counts, plain_counts.double() / N)
    assert tv <= l1_deviation_bound(support, N, DELTA / 2), tv


def _always_accepted(case: Case) -> dict[str, torch.Tensor]:
    """Sequence distributions a broken acceptance rule would produce: every draft kept (the
    draft model's own distribution, or the first token drawn by the target from the prefill and
    the rest by the draft), and, for truncated cases, verification against the target's
    unprocessed distribution (the raw softmax)."""
    p, q = _processed(TARGET_LOGITS, case), _processed(DRAFT_LOGITS, case)
    wrong = {"draft's distribution": _joint(q[PROMPT_TOKEN], q), "target first, draft after": _joint(p[PROMPT_TOKEN], q)}
    if case != Case():
        raw = _processed(TARGET_LOGITS, Case())
        wrong["unprocessed target"] = _joint(raw[PROMPT_TOKEN], raw)
    return wrong


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_check_has_power_against_a_broken_acceptance_rule(name):
    """At the same n, the distributions a wrong acceptance rule would produce fail the chi-square
    check: in expectation (X^2 is about df + n * chi2-divergence over the bins, the noncentrality)
    and on an actual draw of n samples."""
    case = CASES[name]
    exact = _target_joint(case)
    ids, count = _bins(N * exact)
    crit = _chi2_critical(count - 1)
    g = torch.Generator().manual_seed(3)
    for label, wrong in _always_accepted(case).items():
        assert float(wrong.sum()) == pytest.approx(1.0, abs=1e-12)
        b_wrong, b_exact = _binned(wrong, ids, count), _binned(exact, ids, count)
        noncentrality = N * float(((b_wrong - b_exact) ** 2 / b_exact).sum())
        assert count - 1 + noncentrality > 2 * crit, (label, noncentrality, crit)
        counts = torch.bincount(torch.multinomial(wrong.float(), N, replacement=True, generator=g), minlength=V ** L)
        impossible = bool(((exact == 0) & (counts > 0)).any())
        if not impossible:  # drawing a forbidden sequence already fails `_chi2_gof`
            stat, _ = _chi2_gof(counts, exact)
            assert stat > crit, (label, stat, crit)


class _MisreportingDrafter:
    """The draft model, but reporting q = the target's distribution at temperature 1 instead of
    the q it drew from: then min(1, p/q) = 1 and every draft is kept — a broken acceptance."""

    name = "misreporting"

    def __init__(self) -> None:
        self.inner = DraftModelDrafter(MarkovModel(DRAFT_LOGITS))

    def start(self, target, sampler, contexts, keys):
        return _MisreportingState(self.inner.start(target, sampler, contexts, keys))


class _MisreportingState:
    def __init__(self, inner) -> None:
        self.inner = inner

    def propose(self, contexts, limits, ledger):
        draft = self.inner.propose(contexts, limits, ledger)
        p = torch.softmax(TARGET_LOGITS, dim=-1)
        width = draft.tokens.shape[1]
        prev = torch.cat([torch.tensor([[c[-1]] for c in contexts], dtype=torch.long), draft.tokens.cpu()], dim=1)[:, :width]
        return Draft(tokens=draft.tokens, lengths=draft.lengths, probs=p[prev].to(draft.tokens.device))

    def observe(self, verified):
        self.inner.observe(verified)

    def select(self, rows):
        return _MisreportingState(self.inner.select(rows))


def test_a_misreported_q_changes_nothing():
    """End to end: the verification compares each draft with plain sampling's own draw there,
    so a drafter whose reported q is wrong (q = the target's p: an engine that trusted it would
    keep every allowed draft) cannot bias the output: the tokens are the honest drafter's and
    plain sampling's, sample for sample (the same seed)."""
    case = CASES["temperature 1"]
    n = 300
    request = Request(PROMPT, case.params(n, 4))

    def samples(speculative):
        ledger = Ledger()
        out = _generator(speculative).generate([request], ledger=ledger)[0]
        return [c.token_ids for c in out], ledger.usage

    lying, usage = samples(Speculative(_MisreportingDrafter(), num_draft=K))
    honest, _ = samples(Speculative(DraftModelDrafter(MarkovModel(DRAFT_LOGITS)), num_draft=K))
    plain, _ = samples(None)
    assert lying == honest == plain
    assert 0 < usage.accepted_tokens < 0.9 * usage.drafted_tokens  # drafts were verified, and not all kept
