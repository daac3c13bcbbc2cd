"""Compute-optimal strategy selection (Snell et al. 2024, "Scaling LLM Test-Time Compute
Optimally can be More Effective than Scaling Model Parameters"): the best test-time strategy
depends on the budget and on how hard the question is for the model, so choose per budget
and per difficulty bin, on one half of the problems, and report on the other half.

Protocol (every choice is made without the held-out half's ground truth; the oracle
difficulty below reads it only to bin problems):

1. **Split**: the problems every strategy spec has are shuffled with ``seed`` and split into
   a selection half (the larger when odd) and a held-out half.
2. **Difficulty probe** (`agreement_probe`): Snell et al. bin questions by difficulty estimated
   from the model's own samples (their "model-predicted difficulty": a verifier's mean score
   over samples, no ground truth). Ours is cheaper and needs no verifier: the first ``k``
   samples (draw order) of one pooled record of the problem — majority vote with the largest
   pool if there is one, else another pooled strategy whose candidates have answers — and the
   difficulty 1 − (size of their largest answer class)/k; samples without an answer agree with
   nobody. Unanimous samples: 0 (easy); all different: 1 − 1/k. What those k samples cost
   (their own cost plus the record's shared prefill) is **charged to compute-optimal**, within
   its budget and in its held-out compute: a deployment runs the probe first (no credit is
   taken for reusing its samples). No pooled record with answers: one bin ("all"), no probe.
   ``difficulty="pass_rate"`` bins by Snell et al.'s oracle difficulty instead, the model's
   pass rate over the whole pool, uncharged (`metaloom.eval.analysis.difficulty`).
3. **Bins**: edges at the 1/b, 2/b, ... quantiles (lower) of the selection half's
   difficulties, an edge at the maximum moved down to the next distinct value, duplicates
   dropped, so every bin holds selection problems (difficulties are discrete: k+1 levels);
   held-out problems fall in the bin of their difficulty. Names: ``all``; ``easy``/``hard``;
   ``easy``/``medium``/``hard``; ``level1``.. for more.
4. **Budgets** (`budget_grid`): a budget bounds the mean cost per problem on the budget
   metric (FLOPs; output tokens where some point's FLOPs are unknown or all are 0). ``grid``
   budgets log-spaced from the least budget at which compute-optimal has a choice in every bin
   to the largest cost of any point (in any bin, probe included), so every row has a
   compute-optimal accuracy; the baselines may have no point within the smallest budgets (None).
5. **Choice**: for each budget and bin, among the points whose mean cost *plus the probe's*
   over the selection half's problems of that bin is within budget, the best selection-half
   accuracy in that bin (ties: cheaper, then earlier) — compute-optimal pays for its probe
   within the same budget as the baselines. One strategy for every problem is a policy too
   and needs no probe, so the per-bin choices are used only when their selection-half accuracy
   beats the best single strategy's (``policy``: "per bin" or "single", the probe charged only
   for "per bin"); where bins bring nothing, compute-optimal is the best single strategy and
   does not pay to find out a difficulty it does not use. ``best_single`` chooses the same way over the whole
   selection half without bins and without a probe; ``majority_vote``/``best_of_n`` likewise
   among those strategies' points only (every variant, every N). All report held-out accuracy.
6. **Efficiency**: compute-optimal's held-out compute C is the held-out mean cost of each
   problem's chosen point plus the probe's cost. The baseline's held-out curve is each of its
   points' (held-out mean cost, held-out accuracy); the compute it needs is the least cost of a
   baseline point whose held-out accuracy reaches compute-optimal's held-out accuracy (no
   interpolation). ``efficiency = needed / C`` (> 1: compute-optimal needs that many times less
   compute); None when no baseline point reaches it or C is 0. Looking up the baseline on the
   held-out half itself favours the baseline: the ratio is conservative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.curves import Point, interval
from metaloom.eval.analysis.difficulty import make_probe
from metaloom.eval.analysis.subsample import COSTS
from metaloom.eval.records import Record
from metaloom.ledger import PEAKS

BASELINES = ("majority_vote", "best_of_n")


def split(problems: Sequence[str], seed: int) -> tuple[list[str], list[str]]:
    """(selection, held-out): a seeded shuffle cut in two, the selection half the larger when
    odd; each half keeps the input order."""
    if len(problems) < 2:
        raise InvalidParameter("problems", len(problems), "at least 2 problems every strategy has, to split in two")
    order = np.random.default_rng(seed).permutation(len(problems))
    chosen = set(order[: len(problems) - len(problems) // 2].tolist())
    return ([p for i, p in enumerate(problems) if i in chosen], [p for i, p in enumerate(problems) if i not in chosen])


@dataclass(frozen=True)
class Bin:
    """A difficulty bin: problems with difficulty <= ``upper`` (and above the previous bin's)."""

    name: str
    upper: float


def bin_names(count: int) -> list[str]:
    return {1: ["all"], 2: ["easy", "hard"], 3: ["easy", "medium", "hard"]}.get(
        count, [f"level{i + 1}" for i in range(count)])


def difficulty_bins(selection: Mapping[str, float], bins: int = 3) -> list[Bin]:
    """Up to ``bins`` bins from the quantiles of the selection half's difficulties (see the
    module docstring); each holds at least one selection problem."""
    if bins < 1:
        raise InvalidParameter("bins", bins, "an integer >= 1")
    values = np.array(sorted(selection.values()), dtype=np.float64)
    if not values.size:
        return [Bin("all", math.inf)]
    qs = np.quantile(values, [i / bins for i in range(1, bins)], method="lower") if bins > 1 else np.array([])
    distinct = sorted({float(v) for v in values})
    # an edge at the maximum would leave the last bin empty: it moves down to the next value
    edges = sorted({float(q) if q < distinct[-1] else distinct[-2] for q in qs} if len(distinct) > 1 else set())
    names = bin_names(len(edges) + 1)
    return [Bin(n, e) for n, e in zip(names, [*edges, math.inf], strict=True)]


def bin_of(bins: Sequence[Bin], difficulty: float) -> str:
    return next(b.name for b in bins if difficulty <= b.upper)


def budget_metric(pts: Sequence[Point], problems: Sequence[str], preferred: str = "flops") -> str:
    """``preferred`` where every point's cost on it is known and some is non-zero, else output
    tokens. A peak (`metaloom.ledger.PEAKS`: KV memory) is no budget metric: a choice's cost
    here is the strategy's plus its probe's, and the peaks of two calls made one after the
    other do not add up."""
    if preferred not in COSTS or preferred in PEAKS:
        raise InvalidParameter("metric", preferred, f"one of {[c for c in COSTS if c not in PEAKS]}")
    costs = [p.mean_cost(preferred, problems) for p in pts]
    if costs and all(math.isfinite(c) for c in costs) and any(c > 0 for c in costs):
        return preferred
    return "output_tokens"


def budget_grid(lo: float, hi: float, count: int = 12) -> list[float]:
    """``count`` budgets from ``lo`` to ``hi`` (both exact), log-spaced: compute scales by
    orders of magnitude; linear where ``lo`` is 0 (a free point). One budget where hi <= lo."""
    if count < 1:
        raise InvalidParameter("grid", count, "an integer >= 1")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo or count == 1:
        return [max(lo, hi)]
    grid = (np.geomspace(lo, hi, count) if lo > 0 else np.linspace(lo, hi, count)).tolist()
    grid[0], grid[-1] = lo, hi  # exact ends: a point at either end is within
    return [float(b) for b in grid]


def _best(candidates: Sequence[tuple[float, float, int]], budget: float) -> int | None:
    """Among (accuracy, cost, index), the most accurate within budget; ties: cheaper, earlier."""
    within = [(-a, c, i) for a, c, i in candidates if math.isfinite(c) and c <= budget * (1 + 1e-12) and not math.isnan(a)]
    return min(within)[2] if within else None


def _policy_accuracy(choices: Mapping[str, int | None], sel_in: Mapping[str, Sequence[str]],
                     sel_acc: Mapping[str, Sequence[float]]) -> float:
    """Selection-half accuracy of per-bin choices (each bin weighted by its problems)."""
    total = sum(len(ps) for ps in sel_in.values())
    return sum(len(sel_in[b]) * sel_acc[b][i] for b, i in choices.items() if i is not None) / total if total else math.nan


def efficiency(target: float, compute: float, curve: Sequence[tuple[float, float]]) -> float | None:
    """Compute a baseline needs to reach ``target`` accuracy (the least cost among its
    (cost, accuracy) points with accuracy >= target) divided by ``compute``; None when none
    reaches it or ``compute`` is not positive."""
    needed = [c for c, a in curve if a >= target - 1e-12 and math.isfinite(c)]
    if not needed or not compute > 0:
        return None
    return min(needed) / compute


def _intervals(row: dict[str, Any], mine: np.ndarray | None, theirs: Mapping[str, np.ndarray | None], *, seed: int,
               bootstrap: int) -> None:
    """Bootstrap 95% intervals over the held-out problems: of compute-optimal's accuracy
    (``accuracy_lo``/``_hi``), of each baseline's (``NAME_lo``/``_hi``), and of the paired
    difference compute-optimal − baseline (``NAME_difference`` with ``_lo``/``_hi``); None
    where either side has no choice within the budget."""
    row.update(accuracy_lo=None, accuracy_hi=None)
    if mine is not None:
        row["accuracy_lo"], row["accuracy_hi"] = interval(mine, seed=seed, bootstrap=bootstrap)
    for name, values in theirs.items():
        row.update({f"{name}_lo": None, f"{name}_hi": None, f"{name}_difference": None,
                    f"{name}_difference_lo": None, f"{name}_difference_hi": None})
        if values is None:
            continue
        row[f"{name}_lo"], row[f"{name}_hi"] = interval(values, seed=seed, bootstrap=bootstrap)
        if mine is not None:
            diff = mine - values
            row[f"{name}_difference"] = float(diff.mean())
            row[f"{name}_difference_lo"], row[f"{name}_difference_hi"] = interval(diff, seed=seed, bootstrap=bootstrap)


def select(pts: Sequence[Point], records: Sequence[Record], problems: Sequence[str], *, seed: int = 0,
           probe_k: int = 4, bins: int = 3, grid: int = 12, metric: str = "flops", difficulty: str = "agreement",
           bootstrap: int = 1000) -> dict[str, Any]:
    """The compute-optimal analysis over ``problems`` (those every point has): see the module
    docstring. JSON-able except NaN (the caller cleans). Each row: ``budget`` (on
    ``budget_metric``) and ``budget_flops`` (the same, None where the metric is not FLOPs);
    ``choices`` per bin; held-out ``accuracy`` and ``compute`` (probe included, and
    ``probe_compute`` alone); ``best_single``, ``majority_vote``, ``best_of_n`` (held-out accuracy
    of each one's choice, with ``*_choice`` its label; None where nothing fits the budget); and
    ``efficiency_vs_majority``, ``efficiency_vs_best_of_n`` (`efficiency`); bootstrap 95%
    intervals over the held-out problems (`_intervals`). ``difficulty``: the probe that bins
    the problems (`metaloom.eval.analysis.difficulty`: ``agreement`` or ``pass_rate``)."""
    sel_problems, held = split(problems, seed)
    probe = make_probe(difficulty, records, problems, probe_k)
    bin_list = difficulty_bins({p: probe.difficulty[p] for p in sel_problems}, bins if probe.spec else 1)
    where = {p: bin_of(bin_list, probe.difficulty[p]) for p in problems}
    metric = budget_metric(pts, sel_problems, metric)
    sel_in = {b.name: [p for p in sel_problems if where[p] == b.name] for b in bin_list}
    held_in = {b.name: [p for p in held if where[p] == b.name] for b in bin_list}

    sel_acc = {b: [p.accuracy(ps) for p in pts] for b, ps in sel_in.items()}
    # compute-optimal pays for its probe: a bin's cost of a point is the point's plus the probe's
    sel_probe = {b: float(np.mean([probe.cost[p][metric] for p in ps])) for b, ps in sel_in.items()}
    sel_cost = {b: [p.mean_cost(metric, ps) + sel_probe[b] for p in pts] for b, ps in sel_in.items()}
    whole = [(p.accuracy(sel_problems), p.mean_cost(metric, sel_problems), i) for i, p in enumerate(pts)]
    held_acc = [p.accuracy(held) for p in pts]
    held_cost = [p.mean_cost(metric, held) for p in pts]
    probe_cost = float(np.mean([probe.cost[p][metric] for p in held])) if held else 0.0
    by_name = {name: [i for i, p in enumerate(pts) if p.strategy == name] for name in BASELINES}

    known = [[c for c in costs if math.isfinite(c)] for costs in sel_cost.values()]
    lo = max(min(cs) for cs in known) if all(known) else math.nan  # least budget where every bin has a choice
    hi = max([c for cs in known for c in cs] + [c for _, c, _ in whole if math.isfinite(c)], default=math.nan)
    rows = []
    for budget in budget_grid(lo, hi, grid):
        choices = {b: _best([(sel_acc[b][i], sel_cost[b][i], i) for i in range(len(pts))], budget) for b in sel_in}
        single = _best(whole, budget)
        # one strategy for every problem is a policy too, and needs no probe: per-bin choices are
        # used only where they beat it on the selection half (so selection cannot do worse there
        # than the best single strategy; with one bin, or bins that agree, the probe is not paid)
        binned = all(i is not None for i in choices.values()) and len(choices) > 1 and (
            single is None or _policy_accuracy(choices, sel_in, sel_acc) > whole[single][0] + 1e-12)
        if not binned and single is not None:
            choices = dict.fromkeys(sel_in, single)
        row: dict[str, Any] = {"budget_flops": budget if metric == "flops" else None, "budget": budget,
                               "choices": {b: None if i is None else pts[i].label for b, i in choices.items()},
                               "policy": "per bin" if binned else "single"}
        paid = probe_cost if binned else 0.0
        mine = None
        if all(i is not None for i in choices.values()) and held:
            picked = {b: pts[i] for b, i in choices.items() if i is not None}
            mine = np.array([picked[where[p]].correct_at(p) for p in held])
            accuracy = float(mine.mean())
            compute = float(np.mean([picked[where[p]].cost_at(metric, p) for p in held])) + paid
        else:
            accuracy, compute = math.nan, math.nan
        row.update(accuracy=accuracy, compute=compute, probe_compute=paid)
        row["best_single"] = None if single is None else held_acc[single]
        row["best_single_choice"] = None if single is None else pts[single].label
        theirs: dict[str, np.ndarray | None] = {}
        for name, key in (("majority_vote", "efficiency_vs_majority"), ("best_of_n", "efficiency_vs_best_of_n")):
            chosen = _best([whole[i] for i in by_name[name]], budget)
            theirs[name] = None if chosen is None or not held else pts[chosen].correct[pts[chosen].among(held)]
            row[name] = None if chosen is None else held_acc[chosen]
            row[f"{name}_choice"] = None if chosen is None else pts[chosen].label
            curve = [(held_cost[i], held_acc[i]) for i in by_name[name]]
            row[key] = None if math.isnan(accuracy) else efficiency(accuracy, compute, curve)
        theirs["best_single"] = None if single is None or not held else pts[single].correct[pts[single].among(held)]
        _intervals(row, mine, theirs, seed=seed, bootstrap=bootstrap)
        rows.append(row)

    return {"seed": seed, "budget_metric": metric, "selection_problems": sel_problems, "heldout_problems": held,
            "bins": [{"name": b.name, "max_difficulty": b.upper,
                      "problems": [p for p in problems if where[p] == b.name],
                      "selection_problems": sel_in[b.name], "heldout_problems": held_in[b.name]} for b in bin_list],
            "probe": probe.description, "probe_spec": probe.spec, "probe_k": probe.k, "difficulty_kind": difficulty,
            "difficulty": dict(probe.difficulty), "rows": rows}


def row_for_budget(analysis: Mapping[str, Any], budget: float) -> Mapping[str, Any]:
    """The compute-optimal row with the largest budget not above ``budget`` (on the analysis's
    budget metric). ``analysis``: `analyze`'s result or its ``selection``."""
    sel = analysis.get("selection", analysis) if "rows" not in analysis else analysis
    if not sel or not sel.get("rows"):
        raise InvalidParameter("analysis", "no selection", "an analysis with compute-optimal rows (2 problems or more)")
    rows = [r for r in sel["rows"] if r["budget"] <= budget * (1 + 1e-12)]
    if not rows:
        least = min(r["budget"] for r in sel["rows"])
        raise InvalidParameter("budget", budget, f">= {least} ({sel.get('budget_metric', 'flops')}), the least budget analysed")
    return max(rows, key=lambda r: r["budget"])


@dataclass(frozen=True)
class Pick:
    """The compute-optimal pick at one budget, as `metaloom eval --select` prints it and the
    report names it: ``strategy`` (the best single strategy: one spec needs no difficulty
    probe), the row's ``budget`` on ``metric``, its ``per_bin`` choices and ``policy``, the
    pick's held-out accuracy and the per-bin policy's (probe included)."""

    budget: float
    metric: str
    strategy: str
    per_bin: Mapping[str, str | None]
    policy: str
    heldout_accuracy: float | None
    compute_optimal_accuracy: float | None


def pick_for_budget(analysis: Mapping[str, Any], budget: float | None = None) -> Pick:
    """The one selection rule `--select` and the report share: `choice_for_budget` at
    ``budget`` (default: the largest budget analysed), ties broken as `_best` breaks them.
    Raises `InvalidParameter` when the analysis made no selection or the budget is below
    every row's."""
    sel = analysis.get("selection", analysis) if "rows" not in analysis else analysis
    if not sel or not sel.get("rows"):
        reason = analysis.get("selection_reason") or "no selection could be made"
        raise InvalidParameter("analysis", "no selection", f"an analysis with compute-optimal rows ({reason})")
    at = sel["rows"][-1]["budget"] if budget is None else budget
    row = row_for_budget(sel, at)
    return Pick(float(row["budget"]), str(sel.get("budget_metric", "flops")), choice_for_budget(sel, at),
                dict(row.get("choices") or {}), str(row.get("policy") or "single"), row.get("best_single"),
                row.get("accuracy"))


def sweep_seed(config: Mapping[str, Any]) -> int:
    """The seed a sweep ran with (its config.json's ``setup.seed``; 0 where it names none): the
    split `--select`, the report and `scripts/run_tables.py` all use, so that they pick alike."""
    setup = config.get("setup")
    seed = setup.get("seed") if isinstance(setup, Mapping) else config.get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


def choice_for_budget(analysis: Mapping[str, Any], budget: float, bin: str | None = None) -> str:
    """The spec to run at ``budget``: `row_for_budget`'s per-bin choice for ``bin``, else its
    best single strategy (one spec needs no difficulty probe; `metaloom run` and `metaloom
    serve` take it as it is)."""
    row = row_for_budget(analysis, budget)
    if bin is not None:
        if bin not in row["choices"]:
            raise InvalidParameter("bin", bin, f"one of {sorted(row['choices'])}")
        choice = row["choices"][bin]
    else:
        choice = row["best_single_choice"]
    if choice is None:
        raise InvalidParameter("budget", budget, "a budget some strategy fits within")
    return str(choice)
