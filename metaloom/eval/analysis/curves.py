"""Accuracy- and coverage-versus-compute points, their bootstrap intervals, and the Pareto
frontier.

Curves without waste: a pooled (sampling) strategy drew its largest N once per problem;
N = 1, 2, 4, ..., N are read off that pool by subsampling (`metaloom.eval.analysis.subsample`),
each subsample charged what its own samples cost plus the shared prefill. Every other strategy
spec is one point. A point's accuracy is the mean over problems of the expected correctness;
its cost the mean per-problem cost (output tokens, FLOPs, seconds).

Intervals: percentile bootstrap over problems (Efron & Tibshirani 1993): resample the
problems with replacement B times, take the 2.5th and 97.5th percentiles of the resampled
means. Problems are the unit of variation (the samples' own randomness is averaged inside
each problem's expectation). A fixed seed: the same intervals on every run, and points over
the same problems share their resamples (paired).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.subsample import COSTS, outcome
from metaloom.eval.records import POOLED, Record
from metaloom.wiring.spec import Spec, parse_spec


def spec_n(spec: Spec) -> int | None:
    """The spec's ``n`` parameter (None where it has none); not a positive integer: `InvalidParameter`."""
    raw = spec.params.get("n")
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidParameter(f"{spec.text()}: n", raw, "an integer >= 1")
    return n


def family(text: str) -> str:
    """The spec without its ``n``: the curve a point belongs to (``best_of_n@scorer=prm``)."""
    spec = parse_spec(text, "strategy")
    return Spec(spec.name, {k: v for k, v in spec.params.items() if k != "n"}, spec.groups).text()


def with_n(text: str, k: int) -> str:
    """The spec with ``n`` set to k (in its place; first where it had none)."""
    spec = parse_spec(text, "strategy")
    params = dict(spec.params) if "n" in spec.params else {"n": "", **spec.params}
    params["n"] = str(k)
    return Spec(spec.name, params, spec.groups).text()


def sizes(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


@dataclass(frozen=True, eq=False)
class Point:
    """One curve point: ``label`` (a runnable spec), the ``spec`` whose records it is read from,
    ``k`` (the subsample size for a pooled spec, else None), and per problem (in ``problems``
    order): expected ``correct``, ``coverage`` (pooled only) and ``cost`` per `COSTS`."""

    label: str
    spec: str
    family: str
    k: int | None
    problems: tuple[str, ...]
    correct: np.ndarray
    coverage: np.ndarray | None
    cost: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def strategy(self) -> str:
        return parse_spec(self.label).name

    @cached_property
    def _where(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.problems)}

    def covers(self, problem: str) -> bool:
        return problem in self._where

    def among(self, problems: Sequence[str]) -> np.ndarray:
        """Positions of ``problems`` in this point's problems (all must be present)."""
        return np.array([self._where[p] for p in problems], dtype=np.int64)

    def correct_at(self, problem: str) -> float:
        return float(self.correct[self._where[problem]])

    def cost_at(self, metric: str, problem: str) -> float:
        return float(self.cost[metric][self._where[problem]])

    def accuracy(self, problems: Sequence[str] | None = None) -> float:
        values = self.correct if problems is None else self.correct[self.among(problems)]
        return float(values.mean()) if values.size else math.nan

    def mean_cost(self, metric: str, problems: Sequence[str] | None = None) -> float:
        values = self.cost[metric] if problems is None else self.cost[metric][self.among(problems)]
        return float(values.mean()) if values.size else math.nan

    def on(self, problems: Sequence[str]) -> Point:
        """The same point measured on ``problems`` only (all must be among its own)."""
        at = self.among(problems)
        return Point(self.label, self.spec, self.family, self.k, tuple(problems), self.correct[at],
                     None if self.coverage is None else self.coverage[at], {m: v[at] for m, v in self.cost.items()})


def latest(records: Sequence[Record]) -> dict[tuple[str, str], Record]:
    """One record per (problem, spec): the last one (a resumed sweep's redo replaces the cut one)."""
    return {r.key: r for r in records}


def first_seen(values: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(values))


def points(records: Sequence[Record], *, seed: int = 0, draws: int = 200) -> list[Point]:
    """Every point of ``records``: each spec of a `POOLED` strategy at N = 1, 2, 4, ..., N (N:
    its ``n``, else its largest pool), labelled with ``n`` replaced; every other spec once. A
    label some spec was run as directly is read from that spec's own records; otherwise from the
    spec with the largest pool that yields it. A pooled spec none of whose records has
    candidates is one point. A point covers the problems its spec has."""
    table = latest(records)
    problems = first_seen([r.problem for r in records])
    specs = first_seen([r.strategy for r in records])
    by_spec = {s: [table[(p, s)] for p in problems if (p, s) in table] for s in specs}
    canonical = {parse_spec(s).text(): s for s in specs}
    # label -> (pool size, spec, k); direct runs win with an infinite pool
    source: dict[str, tuple[float, str, int | None]] = {}
    for s in specs:
        spec = parse_spec(s)
        if spec.name not in POOLED:
            source[s] = (math.inf, s, None)
            continue
        n = spec_n(spec) or max((len(r.candidates) for r in by_spec[s]), default=1) or 1
        if not any(r.candidates for r in by_spec[s]):  # no pool to subsample (every run failed early)
            source[s] = (math.inf, s, n)
            continue
        for k in sizes(n):
            label = s if k == n and spec_n(spec) is not None else with_n(s, k)
            pool = math.inf if k == n and spec_n(spec) is not None else float(n)
            direct = canonical.get(parse_spec(label).text())
            if direct is not None and direct != s:
                continue  # run directly as its own spec: read from there
            if label not in source or pool > source[label][0]:
                source[label] = (pool, s, k)
    out = []
    for label, (_, s, size) in source.items():
        recs = by_spec[s]
        cells = [outcome(r, size, seed=seed, draws=draws) for r in recs]
        coverage = None if size is None else np.array([c.coverage for c in cells], dtype=np.float64)
        out.append(Point(label, s, family(s), size, tuple(r.problem for r in recs),
                         np.array([c.correct for c in cells], dtype=np.float64), coverage,
                         {m: np.array([c.cost[m] for c in cells], dtype=np.float64) for m in COSTS}))
    order = {s: i for i, s in enumerate(specs)}
    return sorted(out, key=lambda p: (order[p.spec], p.k or 0))


def interval(values: np.ndarray, *, seed: int = 0, bootstrap: int = 1000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean of ``values`` (one per problem): B
    resamples of the problems with replacement, seeded (NaN, NaN when there are none)."""
    m = len(values)
    if m == 0:
        return math.nan, math.nan
    rng = np.random.default_rng([seed, m])
    means = np.asarray(values, dtype=np.float64)[rng.integers(0, m, size=(bootstrap, m))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def point_dict(p: Point, *, seed: int = 0, bootstrap: int = 1000) -> dict[str, object]:
    """A point as the report reads it (NaN where unknown; the caller makes it JSON)."""
    lo, hi = interval(p.correct, seed=seed, bootstrap=bootstrap)
    out: dict[str, object] = {"label": p.label, "spec": p.spec, "k": p.k, "accuracy": p.accuracy(),
                              "accuracy_lo": lo, "accuracy_hi": hi}
    if p.coverage is None:
        out.update(coverage=None, coverage_lo=None, coverage_hi=None)
    else:
        clo, chi = interval(p.coverage, seed=seed, bootstrap=bootstrap)
        out.update(coverage=float(p.coverage.mean()) if p.coverage.size else math.nan, coverage_lo=clo, coverage_hi=chi)
    out.update({m: p.mean_cost(m) for m in COSTS})
    out["problems"] = len(p.problems)
    return out


def curves(pts: Sequence[Point], *, seed: int = 0, bootstrap: int = 1000) -> list[dict[str, object]]:
    """Points grouped by family (in order of first appearance), each family's points by k."""
    fams: dict[str, list[Point]] = {}
    for p in pts:
        fams.setdefault(p.family, []).append(p)
    return [{"family": f, "points": [point_dict(p, seed=seed, bootstrap=bootstrap)
                                     for p in sorted(ps, key=lambda q: (q.k or 0))]}
            for f, ps in fams.items()]


def shared_problems(problem_sets: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The problems to compare points on: accuracies over different problems are not
    comparable (a 22-problem point beside 60-problem ones). Of each point's own problem set,
    the one that (its size) x (points that ran every one of its problems) is largest; ties:
    more problems, then the first. The problems shared by every point where that is as
    good, and never an empty set while some point has problems."""
    best: tuple[int, int, int] | None = None
    chosen: tuple[str, ...] = ()
    held = [set(ps) for ps in problem_sets]
    for i, ps in enumerate(problem_sets):
        if not ps:
            continue
        covering = sum(set(ps) <= h for h in held)
        score = (len(ps) * covering, len(ps), -i)
        if best is None or score > best:
            best, chosen = score, tuple(ps)
    return chosen


def frontier(items: Sequence[tuple[str, float, float]]) -> list[str]:
    """The Pareto frontier of (label, cost, accuracy): the points no other point beats on both
    (cost <= and accuracy >=, one strictly), cheapest first. Of exact duplicates the first
    given is kept; points of unknown (NaN) cost or accuracy are left out."""
    known = [(c, -a, i, label) for i, (label, c, a) in enumerate(items) if not (math.isnan(c) or math.isnan(a))]
    out, best = [], -math.inf
    for _, neg_acc, _, label in sorted(known):
        if -neg_acc > best:
            out.append(label)
            best = -neg_acc
    return out
