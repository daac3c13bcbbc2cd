"""`write_report(DIR)`: one self-contained HTML file for an eval sweep's output directory.

What goes in: ``DIR/config.json`` and ``DIR/records.jsonl`` (`metaloom.eval.records`), the
tree-search traces under ``DIR/traces/``, and the analysis dict of
`metaloom.eval.analysis.analyze` (curves with intervals, frontier, compute-optimal selection,
votes), computed here when the caller does not pass one. Prompts and references are not in
the records: they come from ``problems=`` (the task's `Problem` objects) or, when the sweep
wrote one, ``DIR/problems.jsonl`` (one ``{"id", "prompt", "reference"}`` a line); without
either the drill-down says the prompt was not recorded.

What comes out: one HTML file (jinja2, autoescaped: every text in it is model output or
task data, so all of it is escaped), its CSS inline and its figures embedded as data URIs,
so it opens anywhere, offline, and can be mailed or attached as it is. Python here prepares
plain view dicts; the template only lays them out.

Big sweeps stay usable: each text is cut to `TEXT_CAP` characters, each record shows at most
`CANDIDATE_CAP` candidates and each tree at most `TREE_NODE_CAP` nodes (the best path always),
and the page says what it cut.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from metaloom.errors import InvalidParameter
from metaloom.eval.records import CONFIG, RECORDS, TRACES, Record, read_records
from metaloom.eval.report import figures
from metaloom.search import render

REPORT = "report.html"
PROBLEMS = "problems.jsonl"  # optional: prompts and references, for the drill-down
TEXT_CAP = 2000  # characters of one text (a candidate, a chosen output, a step) shown
# characters of candidate text in the whole page: a sweep with more candidates than fit at
# TEXT_CAP each gets a smaller cap for each (never below MIN_TEXT_CAP), so the page still opens
PAGE_TEXT_BUDGET = 20_000_000
MIN_TEXT_CAP = 200
CANDIDATE_CAP = 64  # candidates shown per record
TREE_NODE_CAP = 1000  # nodes shown per tree (breadth first), the best path always
VOTE_BARS = 8  # answers drawn per vote histogram; the rest summed as "others"
MISSING = "–"  # a figure nobody measured

Analyze = Callable[[list[Record]], Mapping[str, Any]]


# ----------------------------------------------------------------------------------- input


@dataclass(frozen=True)
class Sweep:
    """What the directory holds: its config, its records (the last one of each (problem,
    strategy) key: a resumed sweep may have redone one), and where its traces are."""

    out_dir: str
    config: Mapping[str, Any]
    records: list[Record]
    written: float  # records.jsonl's modification time (the sweep's last record)


def load_sweep(out_dir: str) -> Sweep:
    """Read DIR, or raise `InvalidParameter` naming what is missing or unreadable: a report
    of a directory that is not an eval output would be an empty page that looks like a
    sweep that found nothing."""
    if not os.path.isdir(out_dir):
        raise InvalidParameter("dir", out_dir, "an existing `metaloom eval` output directory (no such directory)")
    missing = [name for name in (CONFIG, RECORDS) if not os.path.isfile(os.path.join(out_dir, name))]
    if missing:
        raise InvalidParameter("dir", out_dir, f"a `metaloom eval` output directory ({' and '.join(missing)} missing)")
    config_path = os.path.join(out_dir, CONFIG)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, OSError) as exc:
        raise InvalidParameter("config", config_path, f"the JSON object `metaloom eval` writes ({exc})") from None
    if not isinstance(config, dict):
        raise InvalidParameter("config", config_path, f"a JSON object, not a JSON {type(config).__name__}")
    records_path = os.path.join(out_dir, RECORDS)
    latest = {r.key: r for r in read_records(records_path)}
    if not latest:
        raise InvalidParameter("dir", out_dir, f"an eval output with at least one record ({RECORDS} holds none yet)")
    return Sweep(out_dir, config, list(latest.values()), os.path.getmtime(records_path))


def default_analyze(records: list[Record], seed: int = 0) -> Mapping[str, Any]:
    """The analysis of `metaloom.eval.analysis` (imported here, when needed: a caller that
    passes its own analysis does not need it), with the sweep's ``seed`` as `--select` uses."""
    from metaloom.eval.analysis import analyze  # type: ignore[import-not-found,unused-ignore]

    result: Mapping[str, Any] = analyze(records, seed=seed)
    return result


def _problem_info(p: Any) -> tuple[str, dict[str, Any]]:
    get = p.get if isinstance(p, Mapping) else lambda k: getattr(p, k, None)
    return str(get("id")), {"prompt": get("prompt"), "reference": get("reference")}


def load_problems(sweep: Sweep, problems: Iterable[Any] | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    """id -> {"prompt", "reference"} for the drill-down, and why there are none when there
    are none. From, in turn: ``problems`` (objects with ``id``, ``prompt``, ``reference``,
    e.g. `metaloom.eval.tasks.base.Problem`, or dicts); ``DIR/problems.jsonl``; the task the
    config names, rebuilt (`metaloom.eval.tasks.make_task`) when its config is the recorded one."""
    if problems is not None:
        return dict(_problem_info(p) for p in problems), None
    path = os.path.join(sweep.out_dir, PROBLEMS)
    if os.path.isfile(path):
        out: dict[str, dict[str, Any]] = {}
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        pid, info = _problem_info(json.loads(line))
                    except (ValueError, TypeError, AttributeError) as exc:
                        raise InvalidParameter("problems", f"{path}:{number}", f'a JSON object with an "id" ({exc})') from None
                    out[pid] = info
        return out, None
    return task_problems(sweep.config)


def task_problems(config: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The problems of the task ``config`` names, rebuilt as the sweep built them, or none and
    why. Best effort: a task that cannot be rebuilt here (an unknown name, a dataset not on
    this machine, a file moved) costs the page its prompts, not the page."""
    setup = mapping(config.get("setup"))
    name = setup.get("task")
    if not isinstance(name, str):
        return {}, "config.json names no task to read the prompts from"
    try:
        from metaloom.eval.tasks import make_task  # type: ignore[attr-defined,unused-ignore]

        task = make_task(name, limit=setup.get("limit"), seed=setup.get("seed", 0))
        if config.get("task") is not None and task.config() != config.get("task"):
            return {}, f"task {name} today is not the task the sweep ran (its config differs)"
        return dict(_problem_info(p) for p in task.problems()), None
    except Exception as exc:  # any failure of someone else's task code only costs the prompts
        return {}, f"task {name} could not be rebuilt here ({type(exc).__name__}: {exc})"


# ------------------------------------------------------------------------------ formatting


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def fmt_flops(v: Any) -> str:
    return render.fmt_flops(v) if _number(v) else MISSING


def fmt_tokens(v: Any) -> str:
    """A token count: an integer as it is, a mean to one decimal."""
    if not _number(v):
        return MISSING
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def run_seconds(r: Record) -> float:
    """What a run cost in seconds: the ledger's (a sample pool replayed from another run of the
    sweep is charged what drawing it took), else the record's wall time."""
    charged = r.usage.get("seconds")
    return float(charged) if isinstance(charged, int | float) else r.seconds


def fmt_seconds(v: Any) -> str:
    if not _number(v):
        return MISSING
    return f"{v:.3g} s" if abs(v) < 100 else f"{v:,.0f} s"


def fmt_pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if _number(v) else MISSING


def fmt_interval(lo: Any, hi: Any) -> str:
    return f"[{100 * lo:.1f}, {100 * hi:.1f}]" if _number(lo) and _number(hi) else ""


def fmt_score(v: Any) -> str:
    return render.fmt_score(v) if _number(v) else MISSING


def fmt_ratio(v: Any) -> str:
    return f"×{v:.3g}" if _number(v) else MISSING


def clip(text: Any, cap: int = TEXT_CAP) -> dict[str, Any]:
    """``text`` cut to ``cap`` characters, and how many were cut (the page says so)."""
    text = "" if text is None else str(text)
    return {"text": text[:cap], "cut": max(0, len(text) - cap), "length": len(text)}


def prompt_text(prompt: Any) -> str | None:
    """A prompt as a person reads it: raw text as it is, chat messages as "role: content"."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, Mapping) else str(m)
                           for m in prompt)
    return str(prompt)


def mapping(v: Any) -> Mapping[str, Any]:
    """``v`` where it is a JSON object, else {} (a field an older or foreign file lacks)."""
    return v if isinstance(v, Mapping) else {}


def _mean(values: Iterable[Any]) -> float | None:
    known = [float(v) for v in values if _number(v)]
    return sum(known) / len(known) if known else None


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


def _points_by_label(analysis: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {p["label"]: p for c in analysis.get("curves") or () for p in c.get("points") or () if "label" in p}


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
        accuracy = point.get("accuracy") if _number(point.get("accuracy")) else (
            sum(r.correct for r in recs) / len(recs) if recs else None)
        rows.append({
            "strategy": spec, "problems": len(recs), "correct": sum(r.correct for r in recs),
            "accuracy": fmt_pct(accuracy), "interval": fmt_interval(point.get("accuracy_lo"), point.get("accuracy_hi")),
            "coverage": fmt_pct(point.get("coverage")),
            "coverage_interval": fmt_interval(point.get("coverage_lo"), point.get("coverage_hi")),
            "output_tokens": fmt_tokens(_mean(r.usage.get("output_tokens") for r in recs)),
            "flops": fmt_flops(_mean(r.usage.get("flops") for r in recs)),
            "seconds": fmt_seconds(_mean(run_seconds(r) for r in recs)),
            "errors": sum(r.error is not None for r in recs),
            "budget_stops": sum(r.stopped_reason == "budget" for r in recs),
        })
    return rows


# -------------------------------------------------------------------------------- curves


def compared_points(analysis: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The points as the frontier compared them (on the analysis's shared problems), by label;
    the points themselves where the analysis compared none."""
    compared = mapping(analysis.get("compared"))
    return _points_by_label({"curves": compared["curves"]}) if compared.get("curves") else _points_by_label(analysis)


def frontier_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """Per cost, the frontier's points in cost order with that cost and their accuracy, on
    the problems they were compared on; and the points left out for running other problems."""
    fmt = {"output_tokens": fmt_tokens, "flops": fmt_flops, "seconds": fmt_seconds}
    points = compared_points(analysis)
    out = []
    frontier = analysis.get("frontier") or {}
    for key, axis in figures.COST_AXES:
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
    styles = figures.family_styles([c["family"] for c in curves])
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
            "difference": f"{100 * diff:+.1f}" if _number(diff) else None,
            "interval": fmt_interval(r.get("difference_lo"), r.get("difference_hi")),
            "curve": fmt_pct(r.get("family_accuracy")), "between": " … ".join(r.get("between") or ()),
            "better": _number(r.get("difference_lo")) and r["difference_lo"] > 0,
            "worse": _number(r.get("difference_hi")) and r["difference_hi"] < 0,
            "reason": (r.get("reason") or "").split(" (")[0], "reason_full": r.get("reason") or ""}
    return {"families": families, "rows": list(rows.values())}


BASELINES = ("majority_vote", "best_of_n", "best_single")  # a selection row's baselines (and their ``_choice``)


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
                     **{key: fmt_pct(r.get(key)) for key in BASELINES},
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
                     "auroc": "–" if not _number(auroc) else f"{auroc:.2f}",
                     "accuracy": fmt_pct(r.get("accuracy")), "random": fmt_pct(r.get("random"))})
    return rows


# --------------------------------------------------------------------------------- trees


def read_trace(out_dir: str, name: str) -> tuple[list[Mapping[str, Any]], str | None]:
    """The tree events of one trace file, or none and why (a missing or unreadable trace
    costs its record the tree, not the whole report)."""
    candidates = [name] if os.path.isabs(name) else [os.path.join(out_dir, name), os.path.join(out_dir, TRACES, name)]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        return [], f"trace file {name} not found under {TRACES}/"
    try:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
    except (ValueError, OSError) as exc:
        return [], f"trace file {name} is not readable JSON ({exc})"
    trees = render.tree_events({"trace": events} if isinstance(events, list) else events)
    if not trees:
        return [], None
    bad = []
    for k, tree in enumerate(trees):
        try:
            render.check_tree(tree, name, f"tree {k + 1}" if len(trees) > 1 else "")
        except InvalidParameter as exc:
            bad.append(str(exc))
    return ([], "; ".join(bad)) if bad else (trees, None)


def node_label(node: Mapping[str, Any]) -> dict[str, Any]:
    """A node's summary line: id, state, finish, scores, tokens, round, any other numeric
    field (MCTS visits and value, a particle's weight), and its step text on one line."""
    fields = []
    if _number(node.get("score")):
        fields.append(f"score {render.fmt_score(node['score'])}")
    if _number(node.get("step_score")):
        fields.append(f"step {render.fmt_score(node['step_score'])}")
    if _number(node.get("tokens")) and (node.get("parent") is not None or node.get("tokens")):
        fields.append(f"{render.fmt_compact(node['tokens'])} tok")
    if node.get("round") is not None:
        fields.append(f"round {node['round']}")
    for key in ("visits", "value"):
        if _number(node.get(key)):
            fields.append(f"{key} {render.fmt_compact(node[key])}")
    fields += [f"{k} {render.fmt_compact(v)}" for k, v in node.items() if k not in render.NODE_KEYS and _number(v)]
    finish = node.get("finish")
    return {"id": node.get("id"), "state": str(node.get("state") or "?"),
            "finish": finish if finish not in (None, "step") else None, "fields": " · ".join(fields),
            "preview": render.one_line(node.get("text"), 90) if node.get("parent") is not None else "the prompt",
            "text": clip(node.get("text"))}


def tree_items(tree: Mapping[str, Any], cap: int = TREE_NODE_CAP) -> tuple[list[dict[str, Any]], int]:
    """The tree as a flat list of ``{"open": node, ...}`` / ``{"close": True}`` items, depth
    first (the template opens a `<details>` per open and closes it per close: nesting with
    no recursion, so a deep tree neither hits Python's nor jinja's limits). Shows the first
    ``cap`` nodes breadth first and the best path; returns how many nodes it left out."""
    nodes = {n["id"]: n for n in tree["nodes"]}
    children: dict[int, list[int]] = {i: [] for i in nodes}
    roots: list[int] = []
    for i, n in nodes.items():
        (roots if n.get("parent") is None else children[n["parent"]]).append(i)
    best_path: set[int] = set()
    at = tree.get("best")
    while at is not None:
        best_path.add(at)
        at = nodes[at].get("parent")
    order = list(roots)
    for i in order:  # breadth first: extends while iterating
        order.extend(children[i])
    keep = set(order[:cap]) | best_path
    items: list[dict[str, Any]] = []
    stack: list[tuple[bool, int]] = [(True, r) for r in reversed(roots) if r in keep]
    while stack:
        opening, i = stack.pop()
        if not opening:
            items.append({"close": True})
            continue
        shown = [c for c in children[i] if c in keep]
        items.append({"close": False, "open": node_label(nodes[i]), "best": i in best_path, "is_best": i == tree.get("best"),
                      "children": len(children[i]), "hidden": len(children[i]) - len(shown)})
        stack.append((False, i))
        stack.extend((True, c) for c in reversed(shown))
    return items, len(nodes) - len(keep)


def _ids(ids: Any, shown: int = 12) -> str:
    """Node ids as "#2 #4", the first ``shown`` of them and how many more."""
    if not isinstance(ids, list):
        return "?"
    return " ".join(f"#{i}" for i in ids[:shown]) + (f" +{len(ids) - shown}" if len(ids) > shown else "")


def rounds_rows(tree: Mapping[str, Any]) -> list[dict[str, str]]:
    """Each round: the nodes it expanded, the children it made, what it cost."""
    out = []
    for k, r in enumerate(tree.get("rounds") or ()):
        if not isinstance(r, Mapping):
            continue
        usage = mapping(r.get("usage"))
        out.append({"round": str(r.get("round", k)), "expanded": _ids(r.get("expanded")),
                    "children": str(len(r["children"]) if isinstance(r.get("children"), list) else r.get("children", "?")),
                    "output_tokens": fmt_tokens(usage.get("output_tokens")), "flops": fmt_flops(usage.get("flops")),
                    "scorer_calls": fmt_tokens(usage.get("scorer_calls"))})
    return out


def tree_view(tree: Mapping[str, Any], anchor: str) -> dict[str, Any]:
    """One search tree: `render.header`'s two lines, node counts, rounds, nested nodes."""
    items, omitted = tree_items(tree)
    return {"anchor": anchor, "header": render.header(tree).plain.splitlines(), "items": items, "omitted": omitted,
            "nodes": len(tree["nodes"]), "counts": render.state_counts(tree), "rounds": rounds_rows(tree),
            "strategy": str(tree.get("strategy") or "tree search"), "stop": tree.get("stop"), "best": tree.get("best")}


# ---------------------------------------------------------------------------- drill-down


def candidate_text_cap(records: Iterable[Record]) -> int:
    """Characters shown of each candidate's text: `TEXT_CAP`, or less where the candidates
    shown would pass `PAGE_TEXT_BUDGET` at that (`MIN_TEXT_CAP` at least)."""
    shown = sum(min(len(r.candidates), CANDIDATE_CAP) for r in records)
    if shown * TEXT_CAP <= PAGE_TEXT_BUDGET:
        return TEXT_CAP
    return max(MIN_TEXT_CAP, PAGE_TEXT_BUDGET // shown)


def candidate_view(c: Any, index: int, text_cap: int = TEXT_CAP) -> dict[str, Any]:
    return {"index": index, "answer": c.answer, "correct": c.correct, "score": fmt_score(c.score),
            "tokens": fmt_tokens(c.tokens), "flops": fmt_flops(c.flops), "seconds": fmt_seconds(c.seconds),
            "text": clip(c.text, text_cap)}


def record_view(r: Record, out_dir: str, anchor: str, text_cap: int = TEXT_CAP) -> dict[str, Any]:
    """One strategy's run on one problem: its grade and cost, the chosen output, its
    candidates (the first `CANDIDATE_CAP`), and its search trees."""
    trees, note = read_trace(out_dir, r.trace) if r.trace else ([], None)
    return {
        "strategy": r.strategy, "answer": r.answer, "correct": r.correct, "score": fmt_score(r.score),
        "output_tokens": fmt_tokens(r.usage.get("output_tokens")), "flops": fmt_flops(r.usage.get("flops")),
        "seconds": fmt_seconds(run_seconds(r)), "stopped": r.stopped_reason, "error": r.error, "best": clip(r.best),
        "candidates": [candidate_view(c, k, text_cap) for k, c in enumerate(r.candidates[:CANDIDATE_CAP])],
        "candidates_total": len(r.candidates), "selection": r.selection.kind if r.selection else None,
        "trees": [tree_view(t, f"{anchor}-t{k}") for k, t in enumerate(trees)], "trace_note": note, "trace": r.trace,
        "anchor": anchor,
    }


def problem_views(problems: Sequence[str], strategies: Sequence[str], by_problem: Mapping[str, Mapping[str, Record]],
                  info: Mapping[str, Mapping[str, Any]], votes: Mapping[str, Any], out_dir: str,
                  text_cap: int = TEXT_CAP) -> list[dict[str, Any]]:
    """One drill-down per problem: prompt, reference, each strategy's run, the vote bars."""
    out = []
    for k, pid in enumerate(problems):
        recs = by_problem.get(pid, {})
        ordered = [recs[s] for s in strategies if s in recs] + [r for s, r in recs.items() if s not in strategies]
        right, wrong = correct_answers(ordered)
        problem_votes = votes.get(pid) or {}
        known = info.get(pid, {})
        out.append({
            "id": pid, "anchor": f"p{k}", "prompt": clip(prompt_text(known.get("prompt")), 4 * TEXT_CAP)
            if known.get("prompt") is not None else None, "reference": known.get("reference"),
            "correct": sum(r.correct for r in ordered), "runs": len(ordered),
            "records": [record_view(r, out_dir, f"p{k}-s{j}", text_cap) for j, r in enumerate(ordered)],
            "votes": [{"strategy": s, **vote_bars(problem_votes[s], right, wrong)}
                      for s in [*(s for s in strategies if s in problem_votes),
                                *(s for s in problem_votes if s not in strategies)]],
        })
    return out


# --------------------------------------------------------------------------------- build


def _environment() -> jinja2.Environment:
    """Autoescape on for every template (the texts are model outputs); undefined names fail
    loudly rather than print nothing."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("metaloom.eval.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["tokens"] = fmt_tokens
    return env


def _ordered(first: Iterable[Any], seen: Iterable[str]) -> list[str]:
    """``first``'s order (the analysis's), then anything only the records have."""
    out = [str(x) for x in first]
    have = set(out)
    out += [x for x in dict.fromkeys(seen) if x not in have]
    return out


def build_report(out_dir: str, *, analysis: Mapping[str, Any] | None = None, analyze: Analyze | None = None,
                 problems: Iterable[Any] | None = None) -> str:
    """The report of DIR as one HTML string. ``analysis``: the dict of
    `metaloom.eval.analysis.analyze` over DIR's records (computed with ``analyze``, default
    that function, when not given); ``problems``: prompts and references (see the module)."""
    sweep = load_sweep(out_dir)
    if analysis is None:
        from metaloom.eval.analysis.select import sweep_seed

        # the sweep's seed: the selection half is the one `metaloom eval --select` chose on
        analysis = analyze(sweep.records) if analyze else default_analyze(sweep.records, sweep_seed(sweep.config))
    recorded = [str(p) for p in sweep.config.get("problems") or () if isinstance(p, str | int)]
    problem_ids = _ordered(analysis.get("problems") or (), [*recorded, *(r.problem for r in sweep.records)])
    strategies = _ordered(analysis.get("strategies") or (), (r.strategy for r in sweep.records))
    by_problem: dict[str, dict[str, Record]] = {}
    for r in sweep.records:
        by_problem.setdefault(r.problem, {})[r.strategy] = r
    points = _points_by_label(analysis)
    info, prompts_note = load_problems(sweep, problems)
    text_cap = candidate_text_cap(sweep.records)
    problem_list = problem_views(problem_ids, strategies, by_problem, info, analysis.get("votes") or {}, out_dir, text_cap)
    trees = [{**t, "problem": p["id"], "strategy": rec["strategy"]} for p in problem_list for rec in p["records"]
             for t in rec["trees"]]
    page = _environment().get_template("report.html.j2").render(
        header=header_view(sweep, problem_ids, strategies),
        summary=summary_rows(sweep.records, strategies, points),
        figures=figures_view(analysis), frontier=frontier_view(analysis),
        equal=equal_compute_view(analysis),
        selection=selection_view(analysis), votes=votes_summary(analysis, by_problem, strategies),
        scorers=scorers_view(analysis),
        problems=problem_list, trees=trees, prompts_note=prompts_note,
        caps={"text": text_cap, "full_text": TEXT_CAP, "budget": PAGE_TEXT_BUDGET, "candidates": CANDIDATE_CAP,
              "nodes": TREE_NODE_CAP},
    )
    return page


def write_report(out_dir: str, *, path: str | None = None, analysis: Mapping[str, Any] | None = None,
                 analyze: Analyze | None = None, problems: Iterable[Any] | None = None) -> str:
    """Write the report (default ``DIR/report.html``) and return its path. Written to a
    temporary file first and renamed: a report open in a browser is never half a page."""
    page = build_report(out_dir, analysis=analysis, analyze=analyze, problems=problems)
    path = path or os.path.join(out_dir, REPORT)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the report from the people it is for
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
