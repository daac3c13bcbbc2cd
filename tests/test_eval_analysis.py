"""`metaloom.eval.analysis`: exact re-picks within subsets (the real strategies' tie rules),
pass@k, curves and intervals, the Pareto frontier, compute-optimal selection."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis import analyze, choice_for_budget, pass_at_k, pick, pick_many, subset_cost
from metaloom.eval.analysis.curves import frontier, interval, points, shared_problems, sizes, with_n
from metaloom.eval.analysis.difficulty import agreement_probe
from metaloom.eval.analysis.select import difficulty_bins, efficiency, split
from metaloom.eval.analysis.subsample import outcome
from metaloom.eval.records import Candidate, Record, Selection
from metaloom.ledger import Ledger
from metaloom.meta import MBR, BestOfN, MajorityVote, WeightedVote
from metaloom.score.answers import LastNumber
from metaloom.testing.scripted import ScriptedGenerator, ScriptedScorer


def cand(answer=None, correct=False, score=None, tokens=10, flops=100.0, seconds=0.5, text=None):
    return Candidate(text=text if text is not None else f"answer {answer}", tokens=tokens, flops=flops, seconds=seconds,
                     answer=answer, correct=correct, score=score)


def pooled(cands, selection, problem="p", strategy="majority_vote@n=8", shared=None, error=None):
    return Record(problem, strategy, None, False, 0.0, "", {}, 0.0, error=error, candidates=tuple(cands),
                  shared=shared or {"flops": 1000.0, "seconds": 1.0}, selection=selection)


def single(problem, strategy, correct, flops=10.0, tokens=5, seconds=0.1, error=None):
    return Record(problem, strategy, "x", correct, float(correct), "x",
                  {"output_tokens": tokens, "flops": flops, "seconds": seconds}, seconds, error=error)


def vote_record(groups, scores=None, kind="majority_vote", transform=None, correct=None):
    scores = scores or [None] * len(groups)
    correct = correct or [False] * len(groups)
    cands = [cand(None if g is None else str(g), c, s) for g, s, c in zip(groups, scores, correct, strict=True)]
    return pooled(cands, Selection(kind, tuple(groups), transform))


# --- pick: each kind's rule, ties included ---------------------------------------------------------


def test_majority_vote_ties_go_to_the_answer_seen_first_in_subset_order():
    r = vote_record([0, 1, 1, 0, None, 2])
    assert pick(r, range(6)) == 0  # 0 and 1 tie at 2 votes: 0 seen first, its first sample
    assert pick(r, [2, 0, 3, 1]) == 2  # same tie, 1 seen first in this order
    assert pick(r, [5, 1, 2]) == 1  # 1 has 2 votes: its first sample
    assert pick(r, [4, 5]) == 5  # the answer-less sample casts no vote
    assert pick(r, [4]) == 4  # no answer at all: the first candidate is kept
    assert pick(r, []) is None


def test_weighted_vote_sums_weights_and_returns_the_best_scored_member():
    r = vote_record([0, 1, 1, 0, None], scores=[0.5, 0.3, 0.2, 0.0, 9.0], kind="weighted_vote", transform="identity")
    assert pick(r, range(5)) == 0  # 0.5 vs 0.5: class 0 seen first; its heaviest member
    assert pick(r, [1, 2, 0, 3]) == 1  # the same tie, class 1 first; member 1 (0.3) beats 2 (0.2)
    assert pick(r, [3, 1]) == 1
    r = vote_record([0, 0, 1], scores=[0.2, 0.2, 0.3], kind="weighted_vote", transform="identity")
    assert pick(r, [1, 0, 2]) == 1  # class 0 (0.4) wins; its members tie at 0.2: the earliest in the subset
    # exp: log-scores become probabilities; -inf weighs nothing
    r = vote_record([0, 1, 1], scores=[math.log(0.5), math.log(0.3), math.log(0.25)], kind="weighted_vote",
                    transform="exp")
    assert pick(r, range(3)) == 1  # 0.55 > 0.5
    r = vote_record([0, 1], scores=[-math.inf, -math.inf], kind="weighted_vote", transform="exp")
    assert pick(r, [1, 0]) == 1  # all weights 0: the class seen first
    r = vote_record([0, 1], scores=[0.3, None], kind="weighted_vote", transform="identity")
    assert pick(r, [0]) == 0
    assert pick(r, [0, 1]) is None  # a sample never scored: the run chose nothing


def test_best_of_n_takes_the_top_score_earliest_in_subset_order():
    r = pooled([cand("1", score=0.5), cand("2", score=0.9), cand("3", score=0.9), cand("4", score=-math.inf)],
               Selection("best_of_n"))
    assert pick(r, range(4)) == 1
    assert pick(r, [2, 1, 0]) == 2
    assert pick(r, [3]) == 3
    assert pick(r, [3, 0]) == 0


def test_mbr_weights_references_by_multiplicity_within_the_subset():
    # distinct texts a, b, c; u[a][b] etc.
    u = ((1.0, 0.0, 0.6), (0.0, 1.0, 0.6), (0.6, 0.6, 1.0))
    r = pooled([cand(text="a"), cand(text="b"), cand(text="c"), cand(text="a"), cand(text="b")],
               Selection("mbr", (0, 1, 2, 0, 1), None, u))
    # all five: EU(a) = (2*1 + 2*0 + 0.6)/5 = 0.52 = EU(b); EU(c) = (2*.6 + 2*.6 + 1)/5 = 0.68
    assert pick(r, range(5)) == 2
    assert pick(r, [0, 1]) == 0  # a and b tie at 0.5: the earliest
    assert pick(r, [1, 0]) == 1
    assert pick(r, [0, 3, 1, 2]) == 2  # EU(a) = (2 + 0 + .6)/4 = .65 < EU(c) = (1.2 + .6 + 1)/4 = .7
    assert pick(r, [2, 0, 3]) == 0  # a twice: EU(a) = (2 + .6)/3 > EU(c) = (1.2 + 1)/3
    assert pick(r, [1, 0, 3]) == 0


def test_unknown_kinds_and_bad_subsets_are_typed_errors():
    with pytest.raises(InvalidParameter, match="kind"):
        pick(pooled([cand("1")], Selection("beam")), [0])
    with pytest.raises(InvalidParameter, match="subset"):
        pick(vote_record([0, 1]), [0, 2])
    with pytest.raises(InvalidParameter, match="subset"):
        pick(vote_record([0, 1]), [1, 1])
    with pytest.raises(InvalidParameter, match="groups"):
        pick(pooled([cand("1"), cand("2")], Selection("majority_vote", (0,))), [0])
    with pytest.raises(InvalidParameter, match="transform"):
        pick(vote_record([0], [1.0], kind="weighted_vote", transform="softmax"), [0])
    with pytest.raises(InvalidParameter, match="Selection"):
        pick(pooled([cand("1")], None), [0])


def _random_record(rng, kind, n):
    groups = [None if rng.random() < 0.15 else int(rng.integers(0, 3)) for _ in range(n)]
    if kind == "best_of_n":
        return pooled([cand(score=float(rng.integers(0, 3)) / 4) for _ in range(n)], Selection(kind))
    if kind == "mbr":
        d = 4
        tri = rng.integers(0, 3, size=(d, d)) / 3
        u = tuple(tuple(float(x) for x in row) for row in (tri + tri.T) / 2 + np.eye(d))
        return pooled([cand() for _ in range(n)], Selection(kind, tuple(int(rng.integers(0, d)) for _ in range(n)), None, u))
    transform = "exp" if rng.random() < 0.5 else "identity"
    scores = [float(rng.choice([0.1, 0.2, 0.3, 0.7])) for _ in range(n)]
    if transform == "exp":
        scores = [math.log(s) if rng.random() < 0.8 else -math.inf for s in scores]
    return vote_record(groups, scores if kind == "weighted_vote" else None, kind, transform)


@pytest.mark.parametrize("kind", ["majority_vote", "weighted_vote", "best_of_n", "mbr"])
def test_pick_many_is_pick_row_by_row(kind):
    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(1, 9))
        r = _random_record(rng, kind, n)
        k = int(rng.integers(1, n + 1))
        subsets = np.argsort(rng.random((40, n)), axis=1)[:, :k]
        assert pick_many(r, subsets).tolist() == [pick(r, row.tolist()) for row in subsets]


# --- equivalence with the real strategies ----------------------------------------------------------

# eight samples: answers 5, 4, 4, 5, 7, none, 5, 4 (ties at n=2, 4 and 8); texts repeat for MBR
TEXTS = ["so 5", "it is 4", "4", "so 5", "maybe 7", "no idea", "then 5", "4"]
SCORES = {"so 5": 0.4, "it is 4": 0.9, "4": 0.4, "maybe 7": 0.9, "no idea": 0.1, "then 5": 0.2}
LOGS = {t: math.log(s) for t, s in SCORES.items()}


def word_overlap(hyps, refs):
    """A utility with many ties: the share of the reference's words the hypothesis has."""
    return [[len(set(h.split()) & set(r.split())) / max(1, len(set(r.split()))) for r in refs] for h in hyps]


def _from_result(result, kind, transform=None):
    """A pooled record built by hand from a strategy's Result."""
    texts = [c.text for c in result.candidates]
    answers = list(result.answers) or [LastNumber().extract(t) for t in texts]
    if kind in ("majority_vote", "weighted_vote"):
        firsts = list(dict.fromkeys(a for a in answers if a is not None))
        selection = Selection(kind, tuple(None if a is None else firsts.index(a) for a in answers), transform)
    elif kind == "mbr":
        distinct = list(Counter(texts))
        event = next(e for e in result.trace if e.kind == "mbr")
        selection = Selection(kind, tuple(distinct.index(t) for t in texts), None,
                              tuple(tuple(row) for row in event.data["matrix"]))
    else:
        selection = Selection(kind)
    scores = list(result.scores) or [None] * len(texts)
    cands = [Candidate(t, len(c.token_ids), 0.0, 0.0, a, a == "4", s)
             for t, c, a, s in zip(texts, result.candidates, answers, scores, strict=True)]
    return pooled(cands, selection, strategy=kind)


STRATEGIES = [
    ("majority_vote", None, lambda n: MajorityVote(n=n, extractor=LastNumber())),
    ("weighted_vote", "identity", lambda n: WeightedVote(scorer=ScriptedScorer(SCORES), n=n, extractor=LastNumber())),
    ("weighted_vote", "exp", lambda n: WeightedVote(scorer=ScriptedScorer(LOGS), n=n, extractor=LastNumber(),
                                                    transform="exp")),
    ("best_of_n", None, lambda n: BestOfN(n=n, scorer=ScriptedScorer(SCORES))),
    ("mbr", None, lambda n: MBR(n=n, utility=word_overlap)),
]


@pytest.mark.parametrize(("kind", "transform", "make"), STRATEGIES, ids=[f"{k}-{t}" for k, t, _ in STRATEGIES])
def test_pick_over_the_first_k_is_what_the_strategy_chose_at_n_k(kind, transform, make):
    full = make(8).run("Q", ScriptedGenerator({"Q": TEXTS}), ledger=Ledger())
    record = _from_result(full, kind, transform)
    assert [c.text for c in record.candidates] == TEXTS
    assert pick(record, range(8)) == full.best_index
    for k in range(1, 8):  # a fresh scripted generator plays the same first k samples
        run = make(k).run("Q", ScriptedGenerator({"Q": TEXTS}), ledger=Ledger())
        assert [c.text for c in run.candidates] == TEXTS[:k]
        assert pick(record, range(k)) == run.best_index, k
        assert pick_many(record, np.arange(k)[None, :]).tolist() == [run.best_index]


def test_the_hand_built_selection_matches_the_sweeps_own():
    from metaloom.eval.pool import selection_of

    for kind, transform, make in STRATEGIES:
        result = make(8).run("Q", ScriptedGenerator({"Q": TEXTS}), ledger=Ledger())
        extractor = None if kind in ("best_of_n", "mbr") else LastNumber()
        assert selection_of(kind, result, extractor, transform) == _from_result(result, kind, transform).selection


# --- costs, expectations, pass@k -------------------------------------------------------------------


def test_subset_cost_is_shared_plus_the_subsets_own():
    cands = [replace(cand("1", tokens=3, flops=10.0, seconds=0.25), kv_bytes=512.0),
             replace(cand("2", tokens=5, flops=20.0, seconds=0.5), kv_bytes=1024.0)]
    r = pooled(cands, Selection("majority_vote", (0, 1)),
               shared={"flops": 100.0, "seconds": 1.0, "input_tokens": 7.0, "kv_bytes_peak": 1792.0})
    assert subset_cost(r, [1]) == {"output_tokens": 5, "flops": 120.0, "seconds": 1.5, "kv_bytes_peak": 2816.0}
    assert subset_cost(r, [0, 1]) == {"output_tokens": 8, "flops": 130.0, "seconds": 1.75, "kv_bytes_peak": 3328.0}


def test_a_record_without_a_measured_peak_has_no_memory_cost():
    """Records written before peaks were measured (or by a remote server): NaN, never 0."""
    r = pooled([cand("1", tokens=3), cand("2", tokens=5)], Selection("majority_vote", (0, 1)))
    assert math.isnan(subset_cost(r, [0])["kv_bytes_peak"]) and math.isnan(outcome(r, 1).cost["kv_bytes_peak"])
    assert math.isnan(outcome(single("p", "greedy", True), None).cost["kv_bytes_peak"])


def test_expected_accuracy_is_the_average_over_ordered_subsets():
    # answers 1, 2, 1, 2: a tie at every even size, so the order decides
    r = vote_record([0, 1, 0, 1, 2], correct=[True, False, True, False, False])
    exact = {k: np.mean([r.candidates[pick(r, list(s))].correct for s in itertools.permutations(range(5), k)])
             for k in range(1, 6)}
    assert outcome(r, 1).correct == pytest.approx(exact[1], abs=1e-12)  # k=1: exact average
    for k in (2, 3, 4, 5):  # k=N too: over orders, not the one the run drew
        assert outcome(r, k, draws=4000).correct == pytest.approx(exact[k], abs=0.03)
    assert outcome(r, 2).cost["flops"] == pytest.approx(1000.0 + 2 * 100.0)
    assert outcome(r, 9).correct == outcome(r, 5).correct  # fewer candidates than k: all of them
    failed = replace(r, error="ScorerFailed: boom")
    assert (outcome(failed, 2).correct, outcome(failed, 2).coverage) == (0.0, 0.0)


def _enumerated(r, k):
    """The mean correctness of ``pick`` over every ordered k-subset of the record's candidates."""
    picks = [pick(r, list(s)) for s in itertools.permutations(range(len(r.candidates)), k)]
    return float(np.mean([p is not None and r.candidates[p].correct for p in picks]))


@pytest.mark.parametrize("trial", range(40))
def test_majority_vote_and_best_of_n_are_the_exact_mean_over_every_ordered_subset(trial):
    """Issue 48: the expectation over sample orders is computed, not estimated from 200
    random orders (runs/gsm read 22.0% where it is 22.08%). Random pools of up to 7 samples,
    ties, answer-less samples, classes with right and wrong members, unscored samples: the
    figure equals the enumeration of every ordered subset to rounding."""
    rng = np.random.default_rng(trial)
    n = int(rng.integers(1, 8))
    groups = [None if g < 0 else int(g) for g in rng.integers(-1, 4, size=n)]
    correct = [bool(g == 0 or rng.random() < 0.15) for g in groups]
    r = vote_record(groups, correct=correct)
    scores = [None if rng.random() < 0.1 else float(rng.choice([0.1, 0.5, 1.0])) for _ in range(n)]
    b = pooled([cand(str(g), c, s) for g, c, s in zip(groups, correct, scores, strict=True)], Selection("best_of_n"),
               strategy="best_of_n@n=8")
    for k in range(1, n + 1):
        assert outcome(r, k, draws=1).correct == pytest.approx(_enumerated(r, k), abs=1e-12)
        assert outcome(b, k, draws=1).correct == pytest.approx(_enumerated(b, k), abs=1e-12)


def test_a_tie_among_m_answers_goes_to_each_with_probability_one_in_m():
    # three answers with 2 votes each over the whole pool: the right one wins in 1/3 of the orders
    r = vote_record([0, 1, 2, 0, 1, 2], correct=[True, False, False, True, False, False])
    assert outcome(r, 6).correct == pytest.approx(1 / 3, abs=1e-15)
    # the record's own flag is one order's pick (here the run's draw order: answer 0 first)
    assert r.candidates[pick(r, range(6))].correct
    # best-of-N with an exact checker (right answers alone at the top score) is pass@k exactly
    b = pooled([cand("a", c, 1.0 if c else 0.0) for c in [True, False, False, False, True, False, False]],
               Selection("best_of_n"), strategy="best_of_n@n=7")
    for k in range(1, 8):
        assert outcome(b, k).correct == pytest.approx(pass_at_k(7, 2, k), abs=1e-15) == outcome(b, k).coverage


def test_pass_at_k_matches_enumeration_of_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                hits = [any(i < c for i in s) for s in itertools.combinations(range(n), k)]
                assert pass_at_k(n, c, k) == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)  # no overflow from huge binomials
    assert pass_at_k(10_000, 3, 1) == pytest.approx(3e-4)
    with pytest.raises(InvalidParameter):
        pass_at_k(3, 1, 4)


# --- curves, intervals, frontier -------------------------------------------------------------------


def test_bootstrap_interval_contains_the_mean_and_narrows_with_more_problems():
    few = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    many = np.tile(few, 20)
    lo, hi = interval(few, seed=3)
    assert lo <= few.mean() <= hi
    lo2, hi2 = interval(many, seed=3)
    assert lo2 <= many.mean() <= hi2
    assert hi2 - lo2 < (hi - lo) / 2
    assert interval(few, seed=3) == (lo, hi)  # seeded
    assert interval(np.array([1.0]), seed=0) == (1.0, 1.0)


def test_pareto_frontier_keeps_the_non_dominated_points_cheapest_first():
    items = [("a", 1.0, 0.5), ("b", 2.0, 0.4), ("c", 2.0, 0.7), ("d", 3.0, 0.7), ("e", 4.0, 0.9),
             ("f", math.nan, 1.0), ("g", 0.5, 0.1), ("h", 4.0, 0.9)]
    assert frontier(items) == ["g", "a", "c", "e"]


def test_sizes_and_labels():
    assert sizes(1) == [1]
    assert sizes(8) == [1, 2, 4, 8]
    assert sizes(12) == [1, 2, 4, 8, 12]
    assert with_n("best_of_n@n=8,scorer=logprob", 2) == "best_of_n@n=2,scorer=logprob"
    assert with_n("majority_vote", 4) == "majority_vote@n=4"


def _pool_records(problem, n, correct_from, strategy):
    """n samples whose answers agree from ``correct_from`` on (answer 1, correct)."""
    groups = [0 if i >= correct_from else 1 + i for i in range(n)]
    cands = [cand(str(g), g == 0, flops=100.0) for g in groups]
    return pooled(cands, Selection("majority_vote", tuple(groups)), problem=problem, strategy=strategy)


def test_points_subsample_pooled_specs_and_keep_the_others_whole():
    records = [_pool_records("p1", 8, 0, "majority_vote@n=8"), _pool_records("p2", 8, 8, "majority_vote@n=8"),
               _pool_records("p1", 4, 0, "majority_vote@n=4"), _pool_records("p2", 4, 4, "majority_vote@n=4"),
               single("p1", "greedy", True), single("p2", "greedy", False, error="ContextWindowExceeded: too long"),
               single("p1", "step_beam_search@n=4,step_scorer=countdown", True, flops=500.0)]
    pts = {p.label: p for p in points(records)}
    assert set(pts) == {"majority_vote@n=1", "majority_vote@n=2", "majority_vote@n=4", "majority_vote@n=8", "greedy",
                        "step_beam_search@n=4,step_scorer=countdown"}
    assert pts["majority_vote@n=4"].spec == "majority_vote@n=4"  # run directly: read from its own records
    assert pts["majority_vote@n=2"].spec == "majority_vote@n=8"  # the larger pool
    assert pts["majority_vote@n=8"].accuracy() == 0.5
    assert pts["majority_vote@n=1"].accuracy() == 0.5  # p1: every sample right; p2: none
    assert pts["greedy"].accuracy() == 0.5  # the failed run counts as incorrect
    assert pts["step_beam_search@n=4,step_scorer=countdown"].problems == ("p1",)
    out = analyze(records, bootstrap=200)
    json.dumps(out, allow_nan=False)
    fams = {c["family"]: c["points"] for c in out["curves"]}
    assert [p["label"] for p in fams["majority_vote"]] == ["majority_vote@n=1", "majority_vote@n=2",
                                                           "majority_vote@n=4", "majority_vote@n=8"]
    p8 = fams["majority_vote"][-1]
    assert (p8["k"], p8["problems"], p8["coverage"], p8["flops"]) == (8, 2, 0.5, 1000.0 + 800.0)
    assert p8["accuracy_lo"] <= p8["accuracy"] <= p8["accuracy_hi"]
    beam = fams["step_beam_search@step_scorer=countdown"][0]
    assert (beam["k"], beam["coverage"], beam["problems"], beam["accuracy"]) == (None, None, 1, 1.0)
    # the search ran on p1 only: its 1.0 is not compared with the others' two problems
    assert out["frontier"]["flops"] == ["greedy"]
    assert out["compared"]["problems"] == ["p1", "p2"]
    assert out["compared"]["outside"] == {"step_beam_search@n=4,step_scorer=countdown": 1}
    assert out["votes"]["p2"]["majority_vote@n=4"] == {"1": 1, "2": 1, "3": 1, "4": 1}
    assert out["votes"]["p1"]["majority_vote@n=8"] == {"0": 8}
    # only p1 is shared by every spec; selection runs on the compared p1 and p2, without the search
    assert sorted(out["selection"]["selection_problems"] + out["selection"]["heldout_problems"]) == ["p1", "p2"]
    assert out["selection"]["outside"] == {"step_beam_search@n=4,step_scorer=countdown": 1}


# --- compute-optimal selection ---------------------------------------------------------------------

EASY = [f"e{i}" for i in range(10)]
HARD = [f"h{i}" for i in range(10)]


def _selection_records():
    """Easy problems (the probe's samples agree): cheap greedy is right, beam search wrong.
    Hard ones (the samples disagree): beam search is right, greedy wrong. Majority vote: right
    on easy, mostly wrong on hard."""
    records = []
    for p in EASY + HARD:
        easy = p in EASY
        groups = [0] * 8 if easy else list(range(8))
        cands = [cand(str(g), easy or i == 7, flops=100.0) for i, g in enumerate(groups)]
        records.append(pooled(cands, Selection("majority_vote", tuple(groups)), problem=p, strategy="majority_vote@n=8"))
        records.append(single(p, "greedy", easy, flops=50.0))
        records.append(single(p, "step_beam_search@n=4", not easy, flops=5000.0))
        records.append(replace(single(p, "best_of_n@n=2", easy, flops=400.0)))
    return records


def test_selection_picks_per_difficulty_bin_on_the_selection_half():
    out = analyze(_selection_records(), seed=1, bootstrap=100, bins=2)
    json.dumps(out, allow_nan=False)
    sel = out["selection"]
    assert sorted(sel["selection_problems"] + sel["heldout_problems"]) == sorted(EASY + HARD)
    bon = next(c for c in out["curves"] if c["family"] == "best_of_n")["points"]
    assert [p["label"] for p in bon] == ["best_of_n@n=2"]  # no candidates to subsample: one point
    assert len(sel["selection_problems"]) == len(sel["heldout_problems"]) == 10
    bins = {b["name"]: set(b["problems"]) for b in sel["bins"]}
    assert bins == {"easy": set(EASY), "hard": set(HARD)}
    assert sel["difficulty"]["e0"] == 0.0 and sel["difficulty"]["h0"] == 0.75  # 4 probe samples, all different
    top = sel["rows"][-1]
    assert top["choices"] == {"easy": "greedy", "hard": "step_beam_search@n=4"}
    assert top["accuracy"] == 1.0
    assert top["best_single"] < 1.0 and top["majority_vote"] < 1.0
    held = sel["heldout_problems"]
    probe = 1000.0 + 4 * 100.0
    want = np.mean([50.0 if p in EASY else 5000.0 for p in held]) + probe
    assert top["compute"] == pytest.approx(want)  # the probe's samples are charged
    budgets = [r["budget"] for r in sel["rows"]]
    assert budgets == sorted(budgets) and budgets[-1] == max(budgets)
    assert sel["budget_metric"] == "flops" and top["budget_flops"] == top["budget"]
    assert choice_for_budget(out, top["budget"], "hard") == "step_beam_search@n=4"
    assert choice_for_budget(out, 1e30) == top["best_single_choice"]
    with pytest.raises(InvalidParameter, match="budget"):
        choice_for_budget(out, budgets[0] / 2)


def test_where_bins_bring_nothing_compute_optimal_is_the_best_single_strategy_without_the_probe():
    # beam search is right everywhere: bins would choose it in both, and paying the probe would
    # only push compute-optimal under the best single strategy at every budget
    records = [replace(r, correct=True) if r.strategy == "step_beam_search@n=4" else r for r in _selection_records()]
    sel = analyze(records, seed=1, bootstrap=100, bins=2)["selection"]
    for row in sel["rows"]:
        assert row["policy"] == "single" and row["probe_compute"] == 0.0
        assert row["accuracy"] == row["best_single"]
        assert set(row["choices"].values()) == {row["best_single_choice"]}
    top = sel["rows"][-1]
    assert top["accuracy"] == 1.0 and top["compute"] == pytest.approx(5000.0)  # no probe charged
    # and where the bins do beat one strategy on the selection half, they are used (and paid)
    base = analyze(_selection_records(), seed=1, bootstrap=100, bins=2)["selection"]["rows"][-1]
    assert base["policy"] == "per bin" and base["probe_compute"] == pytest.approx(1400.0)


def test_heldout_accuracy_reads_only_heldout_problems_and_choices_only_the_selection_half():
    records = _selection_records()
    base = analyze(records, seed=1, bootstrap=100, bins=2)["selection"]
    held, chosen = base["heldout_problems"], base["selection_problems"]
    # a held-out problem's ground truth changes: held-out accuracy moves, choices and bins do not
    flip = next(p for p in held if p in HARD)
    changed = [replace(r, correct=False) if r.key == (flip, "step_beam_search@n=4") else r for r in records]
    # the probe reads no ground truth: flipping every held-out candidate's grade changes no bin
    changed = [replace(r, candidates=tuple(replace(c, correct=not c.correct) for c in r.candidates))
               if r.problem in held and r.candidates else r for r in changed]
    after = analyze(changed, seed=1, bootstrap=100, bins=2)["selection"]
    assert after["bins"] == base["bins"] and after["difficulty"] == base["difficulty"]
    assert [r["choices"] for r in after["rows"]] == [r["choices"] for r in base["rows"]]
    assert after["rows"][-1]["accuracy"] == pytest.approx(1.0 - 1 / len(held))
    # a selection problem's outcome changes nothing held-out when the choice stays the same
    easy_sel = next(p for p in chosen if p in EASY)
    moved = [replace(r, correct=False) if r.key == (easy_sel, "step_beam_search@n=4") else r for r in records]
    assert analyze(moved, seed=1, bootstrap=100, bins=2)["selection"]["rows"][-1]["accuracy"] == 1.0


def test_efficiency_is_the_baselines_compute_to_reach_the_same_accuracy_over_ours():
    assert efficiency(0.8, 100.0, [(50.0, 0.5), (400.0, 0.8), (900.0, 0.9)]) == 4.0
    assert efficiency(0.95, 100.0, [(50.0, 0.5), (900.0, 0.9)]) is None
    assert efficiency(0.5, 0.0, [(50.0, 0.5)]) is None
    out = analyze(_selection_records(), seed=1, bootstrap=100, bins=2)
    sel, held = out["selection"], out["selection"]["heldout_problems"]
    pts = {p.label: p for p in points(_selection_records(), seed=1)}
    majority = [(p.mean_cost("flops", held), p.accuracy(held)) for label, p in pts.items() if label.startswith("majority")]
    checked = 0
    for row in sel["rows"]:
        reach = [c for c, a in majority if a >= row["accuracy"] - 1e-12]
        assert row["efficiency_vs_majority"] == (min(reach) / row["compute"] if reach else None)
        checked += bool(reach)
    assert checked and sel["rows"][-1]["efficiency_vs_majority"] is None  # 100%: majority vote never gets there


def test_split_bins_and_probe():
    sel, held = split([f"p{i}" for i in range(7)], seed=0)
    assert len(sel) == 4 and len(held) == 3 and not set(sel) & set(held)
    assert split([f"p{i}" for i in range(7)], seed=0) == (sel, held)
    with pytest.raises(InvalidParameter):
        split(["only"], seed=0)
    bins = difficulty_bins({"a": 0.0, "b": 0.0, "c": 0.5, "d": 0.75, "e": 0.75, "f": 0.25}, 3)
    assert [b.name for b in bins] == ["easy", "medium", "hard"]
    assert difficulty_bins({"a": 0.0, "b": 0.0}, 3)[0].name == "all"
    probe = agreement_probe(_selection_records(), EASY[:2] + HARD[:1], k=4)
    assert probe.spec == "majority_vote@n=8" and probe.difficulty == {"e0": 0.0, "e1": 0.0, "h0": 0.75}
    assert probe.cost["e0"]["flops"] == 1400.0


def test_selection_edge_cases():
    records = _selection_records()
    out = analyze([r for r in records if r.problem == "e0"])
    assert out["selection"] is None and out["selection_reason"]
    # a problem one spec lacks (an interrupted sweep) is left out of the selection only
    cut = [r for r in records if r.key != ("h3", "greedy")]
    out = analyze(cut, seed=1, bootstrap=50, bins=2)
    greedy = next(c for c in out["curves"] if c["family"] == "greedy")["points"][0]
    assert greedy["problems"] == 19
    sel = out["selection"]
    assert "h3" not in sel["selection_problems"] + sel["heldout_problems"]
    with pytest.raises(InvalidParameter, match="kind"):
        analyze([*records, pooled([cand("1")], Selection("beam_vote", (0,)), problem="x", strategy="majority_vote@n=1")])
    with pytest.raises(InvalidParameter, match="draws"):
        analyze(records, draws=0)
    assert analyze([])["curves"] == [] and analyze([])["selection"] is None


# --- scorers: ranking quality on mixed problems -----------------------------------------------------


def test_auroc_counts_pairs_and_ties_by_hand():
    from metaloom.eval.analysis.scorers import auroc

    # correct 3.0 and 1.0 against wrong 2.0, 1.0, 0.0: pairs won 3 + (0 + 0.5 + 1) = 4.5 of 6
    assert auroc([3.0, 2.0, 1.0, 1.0, 0.0], [True, False, True, False, False]) == pytest.approx(4.5 / 6)
    assert auroc([5.0, 1.0], [False, True]) == 0.0
    assert auroc([1.0, 1.0], [True, False]) == 0.5
    assert auroc([1.0, 2.0], [True, True]) is None and auroc([1.0], [False]) is None


def test_ranking_averages_over_mixed_problems_only():
    from metaloom.eval.analysis.scorers import ranking

    bon = Selection("best_of_n", (), None)
    spec = "best_of_n@n=3,scorer=judge"
    records = [
        # mixed: the correct one ranked first (AUROC 1), and picked
        replace(pooled([cand("1", True, 0.9), cand("2", False, 0.2), cand("3", False, 0.1)], bon, "a", spec),
                correct=True),
        # mixed: the correct one ranked last (AUROC 0), a wrong one picked
        pooled([cand("1", True, 0.1), cand("2", False, 0.5), cand("2", False, 0.4)], bon, "b", spec),
        # not mixed (all wrong): no ranking to judge, counted in problems only
        pooled([cand("4", False, 0.3), cand("5", False, 0.6), cand("6", False, 0.2)], bon, "c", spec),
        # majority vote carries no scores: not a scorer
        pooled([cand("1", True), cand("1", True), cand("2", False)], Selection("majority_vote", (1, 1, 2), None), "a"),
    ]
    (row,) = ranking(records)
    assert row == {"strategy": spec, "problems": 3, "mixed": 2, "auroc": 0.5, "accuracy": 0.5,
                   "random": pytest.approx((1 / 3 + 1 / 3) / 2)}
    assert analyze(records)["scorers"] == [row]


def test_the_eval_summary_and_the_report_tables_define_accuracy_alike():
    """A 1:1 tie between a right and a wrong answer: the run's own order picked the right one
    (its record says correct), but over the order of the samples the vote is right half the
    time. `metaloom eval`'s summary and the analysis (report, run_tables) both say 0.5: one
    definition (they said 1.0 and 0.5, the runs/game24 2.5% against 1.2%)."""
    from metaloom.commands.evaluate import summary

    tie = replace(vote_record([0, 1], correct=[True, False]), problem="p", strategy="majority_vote@n=2", correct=True)
    alone = single("p", "greedy", True)
    rows = summary([tie, alone], ("majority_vote@n=2", "greedy"))
    assert rows["majority_vote@n=2"]["accuracy"] == 0.5  # exact: each tied answer is seen first in half the orders
    assert rows["greedy"]["accuracy"] == 1.0
    [top] = [p for p in points([tie]) if p.label == "majority_vote@n=2"]
    assert top.accuracy() == rows["majority_vote@n=2"]["accuracy"]  # the same orders: the same figure


def test_the_pick_is_the_best_single_choice_and_the_seed_the_sweeps() -> None:
    from metaloom.eval.analysis import pick_for_budget, sweep_seed

    rows = [{"budget": 10.0, "choices": {"all": "greedy"}, "best_single_choice": "greedy", "best_single": 0.1,
             "accuracy": 0.1, "policy": "single"},
            {"budget": 40.0, "choices": {"easy": "greedy", "hard": "majority_vote@n=4"},
             "best_single_choice": "majority_vote@n=2", "best_single": 0.3, "accuracy": 0.4, "policy": "per bin"}]
    analysis = {"selection": {"budget_metric": "output_tokens", "rows": rows}}
    top = pick_for_budget(analysis)
    assert (top.strategy, top.budget, top.metric, top.policy) == ("majority_vote@n=2", 40.0, "output_tokens", "per bin")
    assert pick_for_budget(analysis, 39.0).strategy == "greedy"
    with pytest.raises(InvalidParameter, match="budget"):
        pick_for_budget(analysis, 5.0)
    with pytest.raises(InvalidParameter, match="2 problems"):
        pick_for_budget({"selection": None, "selection_reason": "1 problem(s) shared: needs 2 problems"})
    assert sweep_seed({"setup": {"seed": 2611}}) == 2611 and sweep_seed({}) == 0 and sweep_seed({"setup": {"seed": True}}) == 0


def test_shared_problems_is_the_largest_block_of_points_and_problems():
    sixty, forty, two = [f"p{i}" for i in range(60)], [f"p{i}" for i in range(40)], ["p0", "p1"]
    # 5 points on 60 problems (300), 9 on 40 (with the 5: 14 x 40 = 560), 1 on 2 (15 x 2 = 30)
    assert shared_problems([sixty] * 5 + [forty] * 9 + [two]) == tuple(forty)
    assert shared_problems([sixty] * 12 + [forty] * 3 + [two]) == tuple(sixty)  # 720 > 15 x 40
    assert shared_problems([["a", "b"], ["b", "c"]]) == ("a", "b")  # a tie: the first
    assert shared_problems([[], ["a"]]) == ("a",) and shared_problems([]) == ()


def test_the_frontier_compares_points_on_shared_problems_only():
    """Issue 30: runs/gsm's frontier held a 22-problem rollout point among 60-problem ones. A
    search that ran only on the two easy problems (both right) would beat everything at its
    cost; on the six shared problems it is not measured, so it is left out and said."""
    problems = [f"p{i}" for i in range(6)]
    records = [single(p, "greedy", i < 3, flops=10.0) for i, p in enumerate(problems)]
    records += [_pool_records(p, 4, 0 if i < 4 else 4, "majority_vote@n=4") for i, p in enumerate(problems)]
    records += [single(p, "best_first@k=2", True, flops=50.0) for p in problems[:2]]
    out = analyze(records, bootstrap=100)
    assert out["compared"]["problems"] == problems
    assert out["compared"]["outside"] == {"best_first@k=2": 2}
    for cost in ("flops", "output_tokens", "seconds"):
        assert "best_first@k=2" not in out["frontier"][cost]
    assert out["frontier"]["flops"] == ["greedy", "majority_vote@n=1"]  # 0.5 at 10 FLOPs, then 4/6
    compared = {p["label"]: p for c in out["compared"]["curves"] for p in c["points"]}
    assert set(compared) == {"greedy", "majority_vote@n=1", "majority_vote@n=2", "majority_vote@n=4"}
    assert all(p["problems"] == 6 for p in compared.values())
    own = {p["label"]: p for c in out["curves"] for p in c["points"]}
    assert own["best_first@k=2"]["accuracy"] == 1.0 and own["best_first@k=2"]["problems"] == 2  # still shown as run


def test_selection_runs_on_the_compared_problems_without_the_partial_strategy():
    """runs/gsm's compute-optimal table chose on 1 problem and scored on 1: only 2 were shared by
    every strategy, because two rollout searches ran 2 of 60. It now uses the frontier's problem
    set, and a strategy measured elsewhere is no candidate (and is named)."""
    problems = [f"p{i}" for i in range(8)]
    records = [single(p, "greedy", i % 2 == 0, flops=10.0) for i, p in enumerate(problems)]
    records += [_pool_records(p, 4, 0 if i < 5 else 4, "majority_vote@n=4") for i, p in enumerate(problems)]
    records += [single(p, "best_first@k=2", True, flops=50.0) for p in problems[:2]]
    out = analyze(records, bootstrap=100)
    sel = out["selection"]
    assert sel is not None
    assert sorted(sel["selection_problems"] + sel["heldout_problems"]) == sorted(problems)
    assert sel["outside"] == {"best_first@k=2": 2}
    chosen = {c for row in sel["rows"] for c in row["choices"].values()} | {
        row["best_single_choice"] for row in sel["rows"]}
    assert "best_first@k=2" not in chosen and chosen - {None}
