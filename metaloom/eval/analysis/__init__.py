"""The analysis behind `metaloom eval`'s report and ``--select``: pure functions of the sweep's
records (numpy, no model).

- `subsample`: re-picking within any subset of a pooled record's candidates, exactly as the
  strategy would have (tie rules included), what that subset cost, and pass@k.
- `curves`: accuracy and coverage against output tokens, FLOPs and seconds — N = 1, 2, 4, ...
  read off the largest pool — with bootstrap 95% intervals and the Pareto frontier.
- `equal`: each single-run strategy (a search, greedy) against every sampling curve at the
  same compute, with a paired bootstrap interval on the difference.
- `select`: compute-optimal selection per budget and difficulty bin (Snell et al. 2024), on a
  selection half, reported on a held-out half against best-of-N and majority vote.
- `difficulty`: the difficulty probes selection bins by (answer agreement; the oracle pass rate).
- `scaling`: the exponentiated power law of coverage against samples (Brown et al. 2024).
- `scorers`: how well each pooled strategy's scorer ranks its own candidates (AUROC on the
  problems whose pool holds both correct and wrong answers).

`analyze` puts them together as the JSON the HTML report reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.curves import curves, first_seen, frontier, latest, points, shared_problems
from metaloom.eval.analysis.difficulty import VOTES, make_probe
from metaloom.eval.analysis.equal import at_equal_compute
from metaloom.eval.analysis.scaling import coverage_fit
from metaloom.eval.analysis.scorers import ranking
from metaloom.eval.analysis.select import Pick, choice_for_budget, pick_for_budget, select, sweep_seed
from metaloom.eval.analysis.subsample import COSTS, pass_at_k, pick, pick_many, subset_cost
from metaloom.eval.records import Record

__all__ = ["Pick", "analyze", "choice_for_budget", "pass_at_k", "pick", "pick_for_budget", "pick_many", "subset_cost",
           "sweep_seed", "votes"]


def votes(records: Sequence[Record]) -> dict[str, dict[str, dict[str, int]]]:
    """``{problem: {spec: {answer: count}}}`` of the vote records (majority and weighted vote)
    at their full N: samples per answer class, named by the class's first answer; samples
    without an answer cast no vote."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in latest(records).values():
        sel = r.selection
        if sel is None or sel.kind not in VOTES or not r.candidates:
            continue
        groups = sel.groups if len(sel.groups) == len(r.candidates) else tuple(c.answer for c in r.candidates)
        names: dict[Any, str] = {}
        hist: dict[str, int] = {}
        for g, c in zip(groups, r.candidates, strict=True):
            if g is None or c.answer is None:
                continue
            name = names.setdefault(g, c.answer)
            hist[name] = hist.get(name, 0) + 1
        out.setdefault(r.problem, {})[r.strategy] = hist
    return out


def clean(value: Any) -> Any:
    """JSON-able: NaN and infinities become None, numpy numbers Python numbers."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameter(name, value, "an integer >= 1")


def analyze(records: Sequence[Record], *, seed: int = 0, draws: int = 200, bootstrap: int = 1000,
            probe_k: int = 4, bins: int = 3, grid: int = 12, metric: str = "flops",
            difficulty: str = "agreement") -> dict[str, Any]:
    """Everything the report shows, as JSON-able data (NaN as None):

    ``problems`` and ``strategies`` (first-seen order); ``curves`` (per family, its points with
    accuracy, coverage, bootstrap intervals, mean costs and problem counts); ``compared``: the
    points measured on one problem set (`curves.shared_problems`: ``problems``, and ``curves``
    as above over them) and the points that did not run all of them (``outside``: label ->
    its problem count), which are not compared; ``frontier`` (the Pareto-optimal labels per
    cost among the compared points, on those problems, cheapest first); ``equal_compute`` (each single-run
    strategy against each sampling curve at its ``metric`` cost, `equal.at_equal_compute`);
    ``selection`` (the compute-optimal analysis
    of `metaloom.eval.analysis.select` among the compared points on their problems, with
    ``outside`` as above: a strategy measured on other problems is no candidate; or None with
    ``selection_reason`` when fewer than 2 problems are compared); ``votes`` (answer histograms of the vote records);
    ``scorers`` (each scoring pooled strategy's ranking quality, `scorers.ranking`).

    ``seed``: subsample draws, bootstrap and split; ``draws``: random subsets per (problem, N);
    ``bootstrap``: resamples per interval; ``probe_k``, ``bins``, ``grid``, ``metric``,
    ``difficulty``: the selection's difficulty probe size, bin count, number of budgets, budget
    metric and probe (`difficulty.DIFFICULTIES`). ``coverage_fit``: the exponentiated power law
    of each sample pool's coverage (`scaling.coverage_fit`).
    Records with ``error`` count as incorrect; a problem missing for a spec (an interrupted
    sweep) leaves that spec's points over the problems it has (``problems`` says how many)."""
    make_probe(difficulty, [], [])  # a bad name fails before any work
    for name, value in (("draws", draws), ("bootstrap", bootstrap), ("probe_k", probe_k), ("bins", bins), ("grid", grid)):
        _positive(name, value)
    problems = first_seen([r.problem for r in records])
    strategies = first_seen([r.strategy for r in records])
    pts = points(records, seed=seed, draws=draws)
    # the frontier compares points on the same problems: a point that ran fewer is left out, not mixed in
    shared = shared_problems([p.problems for p in pts])
    on_shared = [p.on(shared) for p in pts if all(p.covers(q) for q in shared)]
    outside = {p.label: len(p.problems) for p in pts if not all(p.covers(q) for q in shared)}
    front = {m: frontier([(p.label, p.mean_cost(m), p.accuracy()) for p in on_shared]) for m in COSTS}
    out: dict[str, Any] = {"problems": problems, "strategies": strategies,
                           "curves": curves(pts, seed=seed, bootstrap=bootstrap), "frontier": front,
                           "compared": {"problems": list(shared), "curves": curves(on_shared, seed=seed, bootstrap=bootstrap),
                                        "outside": outside},
                           "equal_compute": at_equal_compute(pts, metric=metric, seed=seed, bootstrap=bootstrap)}
    if len(shared) < 2:
        out["selection"] = None
        out["selection_reason"] = (f"{len(shared)} problem(s) compared: compute-optimal selection "
                                   "needs at least 2 (a selection half and a held-out half)")
    else:  # the same points and problems as the frontier: a strategy that ran other problems is no candidate
        out["selection"] = select(on_shared, records, list(shared), seed=seed, probe_k=probe_k, bins=bins, grid=grid,
                                  metric=metric, difficulty=difficulty, bootstrap=bootstrap)
        out["selection"]["outside"] = outside
        if not out["selection"]["rows"]:
            out["selection_reason"] = f"no point has a known cost on {out['selection']['budget_metric']}"
    out["coverage_fit"] = coverage_fit(records, seed=seed, bootstrap=bootstrap)
    out["votes"] = votes(records)
    out["scorers"] = ranking(records)
    return clean(out)
