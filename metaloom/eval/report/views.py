"""The report's sections over the whole sweep, as plain dicts the template lays out: the header
(task, model, counts, dates, config), the summary table, the frontier and the figures, the
equal-compute and compute-optimal tables, the vote summary and the scorers. Pure: the data
comes from `metaloom.eval.report.load` and the analysis; the drill-down per problem is
`metaloom.eval.report.drilldown`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from metaloom.eval.records import Record
from metaloom.eval.report import figure_layout, figures
from metaloom.eval.report.cells import (
    MISSING,
    clip,
    fmt_bytes,
    fmt_flops,
    fmt_interval,
    fmt_pct,
    fmt_ratio,
    fmt_seconds,
    fmt_tokens,
    run_seconds,
)
from metaloom.eval.report.load import Sweep, mapping
from metaloom.present.numbers import finite

VOTE_BARS = 8  # answers drawn per vote histogram; the rest summed as "others"


# -------------------------------------------------------------------------------- header


DATE_KEYS = ("created", "started", "date", "time", "timestamp")


def _scalars(d: Mapping[str, Any], skip: Iterable[str]) -> str:
    """``k=v`` for a mapping's plain values (nested ones are in the config dump below)."""
    left = set(skip)
    return ", ".join(f"{k}={v}" for k, v in d.items() if k not in left and v is not None and not isinstance(v, Mapping | list))


def header_view(sweep: Sweep, problems: Sequence[str], strategies: Sequence[str]) -> dict[str, Any]:
    """The task, model, counts and dates at the top of the page, and the whole config (as
    `metaloom.eval.runner` writes it: ``task`` (the task's own config), ``setup`` (model,
    seed, sampling overrides), ``strategies``, ``problems``)."""
    config = sweep.config
    setup, task = mapping(config.get("setup")), mapping(config.get("task"))
    task_name = task.get("name") or setup.get("task") or config.get("task")
    model = setup.get("model") or config.get("model")
    seed = setup.get("seed", config.get("seed"))
    started = next((str(config[k]) for k in DATE_KEYS if config.get(k) is not None), None)
    return {
        "task": str(task_name) if task_name is not None else "?", "task_details": _scalars(task, ("name",)),
        "model": str(model) if model is not None else "?",
        "setup": _scalars(setup, ("task", "model", "seed")),
        "problems": len(problems), "strategies": len(strategies), "records": len(sweep.records),
        "seed": seed, "started": started,
        "written": dt.datetime.fromtimestamp(sweep.written).astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "generated": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "out_dir": os.path.abspath(sweep.out_dir),
        "config_json": json.dumps(config, indent=2, sort_keys=True, default=str),
    }


# ------------------------------------------------------------------------------- summary


def points_by_label(analysis: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {p["label"]: p for c in analysis.get("curves") or () for p in c.get("points") or () if "label" in p}


def _mean(values: Iterable[Any]) -> float | None:
    known = [float(v) for v in values if finite(v)]
    return sum(known) / len(known) if known else None


def summary_rows(records: Sequence[Record], strategies: Sequence[str],
                 points: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per strategy spec: accuracy (with the analysis's 95% interval when it has a
    point of that label), coverage, mean costs, errors and budget stops, counted from the
    records."""
    by_strategy: dict[str, list[Record]] = {s: [] for s in strategies}
    for r in records:
        by_strategy.setdefault(r.strategy, []).append(r)
    rows = []
    for spec, recs in by_strategy.items():
        point = points.get(spec, {})
        accuracy = point.get("accuracy") if finite(point.get("accuracy")) else (
            sum(r.correct for r in recs) / len(recs) if recs else None)
        rows.append({
            "strategy": spec, "problems": len(recs), "correct": sum(r.correct for r in recs),
            "accuracy": fmt_pct(accuracy), "interval": fmt_interval(point.get("accuracy_lo"), point.get("accuracy_hi")),
            "coverage": fmt_pct(point.get("coverage")),
            "coverage_interval": fmt_interval(point.get("coverage_lo"), point.get("coverage_hi")),
            "output_tokens": fmt_tokens(_mean(r.usage.get("output_tokens") for r in recs)),
            "flops": fmt_flops(_mean(r.usage.get("flops") for r in recs)),
            "seconds": fmt_seconds(_mean(run_seconds(r) for r in recs)),
            "kv_bytes_peak": fmt_bytes(_mean(r.usage.get("kv_bytes_peak") for r in recs)),
            "errors": sum(r.error is not None for r in recs),
            "budget_stops": sum(r.stopped_reason == "budget" for r in recs),
        })
    return rows


# -------------------------------------------------------------------------------- curves


def compared_points(analysis: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The points as the frontier compared them (on the analysis's shared problems), by label;
    the points themselves where the analysis compared none."""
    compared = mapping(analysis.get("compared"))
    return points_by_label({"curves": compared["curves"]}) if compared.get("curves") else points_by_label(analysis)


def frontier_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """Per cost, the frontier's points in cost order with that cost and their accuracy, on
    the problems they were compared on; and the points left out for running other problems."""
    fmt = {"output_tokens": fmt_tokens, "flops": fmt_flops, "seconds": fmt_seconds, "kv_bytes_peak": fmt_bytes}
    points = compared_points(analysis)
    out = []
    frontier = analysis.get("frontier") or {}
    for key, axis in figure_layout.cost_axes(list(points.values())):
        rows = []
        for label in frontier.get(key) or ():
            p = points.get(label, {})
            rows.append({"label": label, "cost": fmt[key](p.get(key)), "accuracy": fmt_pct(p.get("accuracy")),
                         "interval": fmt_interval(p.get("accuracy_lo"), p.get("accuracy_hi"))})
        out.append({"key": key, "axis": axis, "rows": rows})
    compared = mapping(analysis.get("compared"))
    outside = mapping(compared.get("outside"))
    return {"costs": out, "problems": len(compared.get("problems") or ()) or None,
            "compared": len(points) if compared else None,
            "outside": [{"label": k, "problems": v} for k, v in outside.items()]}


def figures_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """The accuracy and coverage figures, and a note for points a log axis could not place.
    The accuracy figure draws the points compared on one problem set, and hollow the ones
    measured on others (`metaloom.eval.analysis`'s ``compared``)."""
    curves = [c for c in analysis.get("curves") or () if c.get("points")]
    styles = figure_layout.family_styles([c["family"] for c in curves])
    compared = mapping(analysis.get("compared"))
    outside = set(mapping(compared.get("outside")))
    shown = [c for c in compared.get("curves") or () if c.get("points")] if compared else curves
    apart = [{"family": c["family"], "points": [p for p in c["points"] if p.get("label") in outside]} for c in curves]
    apart = [c for c in apart if c["points"]]
    drawn = figures.accuracy_figure(shown, analysis.get("frontier") or {}, styles, apart)
    accuracy, left_out = drawn if drawn is not None else (None, 0)
    return {"accuracy": accuracy, "left_out": left_out, "coverage": figures.coverage_figure(curves, styles),
            "families": len(curves), "points": sum(len(c["points"]) for c in curves),
            "compared_problems": len(compared.get("problems") or ()) if compared else None, "outside": len(outside)}


def equal_compute_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """Each single-run strategy (a row) against each sampling curve (a column) at the row's
    FLOPs (`metaloom.eval.analysis.equal`): per cell the paired difference in points with its
    interval and the curve's accuracy there, or why there is none."""
    rows: dict[str, dict[str, Any]] = {}
    families: list[str] = []
    for r in analysis.get("equal_compute") or ():
        fam = str(r.get("family"))
        if fam not in families:
            families.append(fam)
        row = rows.setdefault(str(r.get("strategy")), {"strategy": r.get("strategy"), "cells": {},
                                                       "cost": fmt_flops(r.get("cost")),
                                                       "accuracy": fmt_pct(r.get("accuracy")),
                                                       "problems": r.get("problems")})
        diff = r.get("difference")
        row["cells"][fam] = {
            "difference": f"{100 * diff:+.1f}" if finite(diff) else None,
            "interval": fmt_interval(r.get("difference_lo"), r.get("difference_hi")),
            "curve": fmt_pct(r.get("family_accuracy")), "between": " … ".join(r.get("between") or ()),
            "better": finite(r.get("difference_lo")) and r["difference_lo"] > 0,
            "worse": finite(r.get("difference_hi")) and r["difference_hi"] < 0,
            "reason": (r.get("reason") or "").split(" (")[0], "reason_full": r.get("reason") or ""}
    return {"families": families, "rows": list(rows.values())}


BASELINES = ("majority_vote", "best_of_n", "best_single")  # a selection row's baselines (and their ``_choice``)


def _points(diff: Any, lo: Any, hi: Any) -> str:
    """A paired difference in points with its interval ("+5.0 [-2.5, +12.5]"), or empty."""
    if not finite(diff):
        return ""
    interval = f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if finite(lo) and finite(hi) else ""
    return f"{100 * diff:+.1f}{interval}"


def selection_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """The compute-optimal table: per FLOPs budget, each difficulty bin's choice and the
    held-out accuracy against the baselines; or why there is none."""
    selection = analysis.get("selection")
    if not selection:
        reason = analysis.get("selection_reason") or "the analysis made no compute-optimal selection"
        return {"rows": [], "reason": reason, "bins": [], "figure": None}
    bins = [b.get("name", "?") for b in selection.get("bins") or ()]
    from metaloom.eval.analysis.select import pick_for_budget

    # what `metaloom eval --select` prints for this sweep: the same function, the same ties
    chosen = pick_for_budget(selection) if selection.get("rows") else None
    rows = []
    for r in selection.get("rows") or ():
        budget = fmt_flops(r["budget_flops"]) if r.get("budget_flops") is not None else (
            f"{r['budget']:,.0f} {selection.get('budget_metric', '')}".replace("_", " ") if r.get("budget") is not None
            else MISSING)
        compute = fmt_flops(r.get("compute")) if r.get("budget_flops") is not None else (
            MISSING if r.get("compute") is None else f"{r['compute']:,.0f}")
        rows.append({"budget": budget, "policy": r.get("policy") or "",
                     "choices": [(r.get("choices") or {}).get(b, MISSING) for b in bins],
                     "accuracy": fmt_pct(r.get("accuracy")), "compute": compute,
                     "interval": fmt_interval(r.get("accuracy_lo"), r.get("accuracy_hi")),
                     **{key: fmt_pct(r.get(key)) for key in BASELINES},
                     **{f"{key}_interval": fmt_interval(r.get(f"{key}_lo"), r.get(f"{key}_hi")) for key in BASELINES},
                     **{f"{key}_difference": _points(r.get(f"{key}_difference"), r.get(f"{key}_difference_lo"),
                                                     r.get(f"{key}_difference_hi")) for key in BASELINES},
                     **{f"{key}_choice": r.get(f"{key}_choice") or "" for key in BASELINES},
                     "vs_majority": fmt_ratio(r.get("efficiency_vs_majority")),
                     "vs_best_of_n": fmt_ratio(r.get("efficiency_vs_best_of_n"))})
    return {
        "rows": rows, "bins": bins, "reason": selection.get("reason") if not rows else None,
        "pick": None if chosen is None else {
            "strategy": chosen.strategy, "accuracy": fmt_pct(chosen.heldout_accuracy),
            "budget": fmt_flops(chosen.budget) if chosen.metric == "flops"
            else f"{chosen.budget:,.0f} {chosen.metric}".replace("_", " ")},
        "seed": selection.get("seed"), "probe": selection.get("probe"),
        "selection_problems": len(selection.get("selection_problems") or ()),
        "heldout_problems": len(selection.get("heldout_problems") or ()),
        "bin_sizes": [(b.get("name", "?"), len(b.get("problems") or ())) for b in selection.get("bins") or ()],
        "outside": [f"{label} ({count} problems)" for label, count in mapping(selection.get("outside")).items()],
        "figure": figures.selection_figure(selection.get("rows") or ()),
    }


# --------------------------------------------------------------------------------- votes


def correct_answers(records: Iterable[Record]) -> tuple[set[str], set[str]]:
    """The answers graded right and those graded wrong, over one problem's records and their
    candidates (the grader's word, not a string match with the reference)."""
    right: set[str] = set()
    wrong: set[str] = set()
    for r in records:
        for answer, correct in [(r.answer, r.correct), *((c.answer, c.correct) for c in r.candidates)]:
            if answer is not None:
                (right if correct else wrong).add(answer)
    return right, wrong


CHOSEN_RIGHT, OUTVOTED, NONE_RIGHT, NO_VOTES = (name for name, _ in figures.VOTE_OUTCOMES)


def vote_outcome(counts: Mapping[str, int], right: set[str], record: Record | None) -> str:
    """Which `figures.VOTE_OUTCOMES` class one (problem, strategy) falls in: the record's own
    grade says whether the chosen answer was right (ties broken the strategy's way); without
    a record, the most-voted answer."""
    if not counts or not sum(counts.values()):
        return NO_VOTES
    chosen_right = record.correct if record is not None else max(counts, key=lambda a: counts[a]) in right
    if chosen_right:
        return CHOSEN_RIGHT
    if any(a in right and n > 0 for a, n in counts.items()):
        return OUTVOTED
    return NONE_RIGHT


def vote_bars(counts: Mapping[str, int], right: set[str], wrong: set[str]) -> dict[str, Any]:
    """One small bar chart (HTML bars): the `VOTE_BARS` most-voted answers, widths relative
    to the most votes, right answers green and wrong ones red, the rest summed."""
    ranked = sorted(counts.items(), key=lambda an: (-an[1], an[0]))
    top = max((n for _, n in ranked), default=0) or 1
    bars = [{"answer": clip(a, 80)["text"], "count": n, "width": round(100 * n / top, 1),
             "grade": "right" if a in right else "wrong" if a in wrong else "unknown"} for a, n in ranked[:VOTE_BARS]]
    return {"bars": bars, "others": sum(n for _, n in ranked[VOTE_BARS:]), "other_answers": max(0, len(ranked) - VOTE_BARS),
            "total": sum(counts.values())}


def vote_outcomes(analysis: Mapping[str, Any], by_problem: Mapping[str, Mapping[str, Record]],
                  strategies: Sequence[str]) -> list[tuple[str, dict[str, int]]]:
    """Per voting strategy (those the analysis has votes of), problems by `vote_outcome`."""
    votes = analysis.get("votes") or {}
    specs = [s for s in strategies if any(s in (votes.get(p) or {}) for p in votes)]
    specs += sorted({s for p in votes.values() for s in p} - set(specs))
    rows = []
    for spec in specs:
        outcomes: Counter[str] = Counter()
        for pid, per_spec in votes.items():
            if spec in per_spec:
                recs = by_problem.get(pid, {})
                outcomes[vote_outcome(per_spec[spec], correct_answers(recs.values())[0], recs.get(spec))] += 1
        rows.append((spec, dict(outcomes)))
    return rows


def votes_summary(analysis: Mapping[str, Any], by_problem: Mapping[str, Mapping[str, Record]],
                  strategies: Sequence[str]) -> dict[str, Any]:
    """The vote summary figure."""
    rows = vote_outcomes(analysis, by_problem, strategies)
    return {"figure": figures.vote_summary_figure(rows), "strategies": len(rows)}


def scorers_view(analysis: Mapping[str, Any]) -> list[dict[str, str]]:
    """The scorer table (`metaloom.eval.analysis.scorers`): per scoring pooled strategy, its
    AUROC and its pick's accuracy against a random pick's on the mixed problems."""
    rows = []
    for r in analysis.get("scorers") or ():
        auroc = r.get("auroc")
        rows.append({"strategy": str(r["strategy"]), "problems": str(r["problems"]), "mixed": str(r["mixed"]),
                     "auroc": "–" if not finite(auroc) else f"{auroc:.2f}",
                     "accuracy": fmt_pct(r.get("accuracy")), "random": fmt_pct(r.get("random"))})
    return rows
