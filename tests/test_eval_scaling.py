"""`metaloom.eval.analysis.scaling` (the exponentiated power law of coverage, Brown et al. 2024)
and `metaloom.eval.analysis.difficulty` (the oracle pass-rate bins of Snell et al. 2024), with
the held-out intervals of compute-optimal selection."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis import analyze
from metaloom.eval.analysis.difficulty import agreement_probe, make_probe, pass_rate_probe
from metaloom.eval.analysis.scaling import coverage_fit, fit_power_law, pools, predict
from metaloom.eval.analysis.subsample import pass_at_k
from metaloom.eval.records import Candidate, Record, Selection


def sse(a, b, k, c):
    return sum((math.log(ci) - a * ki**b) ** 2 for ki, ci in zip(k, c, strict=True))


def test_an_exact_power_law_is_recovered():
    k = [1, 2, 4, 8, 16, 32, 64]
    a, b = fit_power_law(k, predict(-2.3, -0.42, k))
    assert (a, b) == (pytest.approx(-2.3, abs=1e-7), pytest.approx(-0.42, abs=1e-7))


def test_the_fit_is_least_squares_on_log_coverage():
    """Noisy points: the fit minimises the squared error of log coverage (the paper's
    objective), which a straight line through log(-log c) against log k does not."""
    k = np.array([1, 2, 4, 8, 16, 32, 64], dtype=float)
    rng = np.random.default_rng(3)
    c = np.exp(-2.0 * k**-0.5) * np.exp(rng.normal(0, 0.15, k.size))
    c = np.minimum(c, 0.99)
    a, b = fit_power_law(k.tolist(), c.tolist())
    best = sse(a, b, k, c)
    for da, db in [(1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3), (1e-3, 1e-3), (-1e-3, -1e-3)]:
        assert best <= sse(a + da, b + db, k, c) + 1e-15
    # the log-log line gives other parameters and a larger error on log coverage
    slope, icept = np.polyfit(np.log(k), np.log(-np.log(c)), 1)
    assert best < sse(-math.exp(icept), slope, k, c) - 1e-6


def test_points_without_coverage_are_left_out_and_too_few_are_an_error():
    k = [1, 2, 4, 8]
    a, b = fit_power_law(k, [0.0, *predict(-1.5, -0.3, k[1:])])
    assert (a, b) == (pytest.approx(-1.5, abs=1e-6), pytest.approx(-0.3, abs=1e-6))
    with pytest.raises(InvalidParameter, match="two distinct k"):
        fit_power_law(k, [0.0, 0.0, 0.0, 0.2])
    with pytest.raises(InvalidParameter, match="one coverage per k"):
        fit_power_law(k, [0.1, 0.2])


def pool(problem, correct, strategy="majority_vote@n=8"):
    cands = tuple(Candidate(text="t", tokens=5, flops=10.0, seconds=0.1, answer=str(i % 3), correct=c)
                  for i, c in enumerate(correct))
    return Record(problem, strategy, None, False, 0.0, "", {}, 0.0, candidates=cands, shared={"flops": 5.0},
                  selection=Selection("majority_vote", tuple(i % 3 for i in range(len(correct)))))


def test_coverage_fit_reads_one_curve_per_pool_and_gives_residuals_and_intervals():
    right = {"p0": [True] * 8, "p1": [True, False, False, False, False, False, False, False],
             "p2": [False] * 7 + [True], "p3": [False] * 8, "p4": [True, True] + [False] * 6}
    records = [pool(p, c) for p, c in right.items()]
    # a second strategy on the same draw: the same pool, one curve
    records += [pool(p, c, "best_of_n@n=8,scorer=logprob") for p, c in right.items()]
    assert len(pools(records)) == 1
    [fit] = coverage_fit(records, bootstrap=200)
    assert fit["spec"] == "majority_vote@n=8" and fit["problems"] == 5 and fit["k"] == [1, 2, 4, 8]
    want = [np.mean([pass_at_k(8, sum(c), k) for c in right.values()]) for k in (1, 2, 4, 8)]
    assert fit["coverage"] == pytest.approx(want, abs=1e-12)
    assert fit["fitted"] == pytest.approx(predict(fit["a"], fit["b"], fit["k"]))
    assert fit["residual"] == pytest.approx([c - f for c, f in zip(want, fit["fitted"], strict=True)])
    logs = [math.log(c) - fit["a"] * k ** fit["b"] for c, k in zip(want, fit["k"], strict=True)]
    assert fit["residual_log"] == pytest.approx(logs)
    assert fit["a_lo"] <= fit["a"] <= fit["a_hi"] and fit["b_lo"] <= fit["b"] <= fit["b_hi"]
    assert fit["rms"] == pytest.approx(math.sqrt(np.mean(np.square(fit["residual"]))))
    # nothing covered anywhere: no fit, and why
    [none] = coverage_fit([pool("q", [False] * 4)], bootstrap=10)
    assert none["a"] is None and "two distinct k" in none["reason"]


def test_pass_rate_bins_read_the_whole_pool_and_charge_nothing():
    records = [pool("easy", [True] * 7 + [False]), pool("mid", [True] * 4 + [False] * 4), pool("hard", [False] * 8)]
    probe = pass_rate_probe(records, ["easy", "mid", "hard"])
    assert probe.difficulty == {"easy": 0.125, "mid": 0.5, "hard": 1.0}
    assert all(v == 0.0 for cost in probe.cost.values() for v in cost.values())
    assert "oracle" in probe.description and probe.spec == "majority_vote@n=8"
    # the agreement probe reads no ground truth and charges its 4 samples
    agree = agreement_probe(records, ["easy", "mid", "hard"])
    assert agree.cost["easy"]["flops"] == pytest.approx(5.0 + 4 * 10.0)
    assert make_probe("pass_rate", records, ["easy"]).difficulty == {"easy": 0.125}
    with pytest.raises(InvalidParameter, match="difficulty"):
        make_probe("oracle", records, ["easy"])


def single(problem, strategy, correct, flops):
    return Record(problem, strategy, "x", correct, float(correct), "x",
                  {"output_tokens": 5, "flops": flops, "seconds": 0.1}, 0.1)


def test_selection_by_pass_rate_has_held_out_intervals_and_paired_differences():
    rng = np.random.default_rng(0)
    records = []
    for i in range(24):
        rate = i / 23
        correct = [bool(x) for x in rng.random(8) < rate]
        records.append(pool(f"p{i}", correct))
        records.append(single(f"p{i}", "greedy", bool(correct[0]), 20.0))
    with pytest.raises(InvalidParameter, match="difficulty"):
        analyze(records, difficulty="nope")
    a = analyze(records, difficulty="pass_rate", bins=2, bootstrap=200)
    sel = a["selection"]
    assert sel["difficulty_kind"] == "pass_rate" and "oracle" in sel["probe"]
    assert sel["difficulty"]["p0"] == 1.0 - sum(c.correct for c in records[0].candidates) / 8
    for row in sel["rows"]:
        assert row["probe_compute"] == 0.0  # the oracle is not charged
        assert row["accuracy_lo"] <= row["accuracy"] <= row["accuracy_hi"]
        if row["majority_vote"] is not None:
            assert row["majority_vote_lo"] <= row["majority_vote"] <= row["majority_vote_hi"]
            assert row["majority_vote_difference"] == pytest.approx(row["accuracy"] - row["majority_vote"])
            assert row["majority_vote_difference_lo"] <= row["majority_vote_difference"] <= row["majority_vote_difference_hi"]
        else:
            assert row["majority_vote_difference"] is None
    assert analyze(records, bootstrap=50)["selection"]["difficulty_kind"] == "agreement"
    assert a["coverage_fit"][0]["spec"] == "majority_vote@n=8"
