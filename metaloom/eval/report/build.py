"""`write_report(DIR)`: one self-contained HTML file for an eval sweep's output directory.

Read (`metaloom.eval.report.load`: ``DIR/config.json``, ``DIR/records.jsonl``, the prompts,
the tree-search traces under ``DIR/traces/``), analysed (`metaloom.eval.analysis.analyze`:
curves with intervals, frontier, compute-optimal selection, votes; computed here when the
caller does not pass one), turned into plain view dicts (`views` for the sweep, `drilldown`
per problem, `cells` for each figure and text), laid out by the template and written.

What comes out: one HTML file (jinja2, autoescaped: every text in it is model output or
task data, so all of it is escaped), its CSS inline and its figures embedded as data URIs,
so it opens anywhere, offline, and can be mailed or attached as it is. Python prepares the
view dicts; the template only lays them out.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jinja2

from metaloom.eval.records import Record
from metaloom.eval.report import cells, coverage, drilldown, load, views

REPORT = "report.html"

Analyze = Callable[[list[Record]], Mapping[str, Any]]


def default_analyze(records: list[Record], seed: int = 0, **options: Any) -> Mapping[str, Any]:
    """The analysis of `metaloom.eval.analysis` (imported here, when needed: a caller that
    passes its own analysis does not need it), with the sweep's ``seed`` as `--select` uses;
    ``options``: `analyze`'s keywords (``difficulty``, ``bins``)."""
    from metaloom.eval.analysis import analyze  # type: ignore[import-not-found,unused-ignore]

    result: Mapping[str, Any] = analyze(records, seed=seed, **options)
    return result


def _environment() -> jinja2.Environment:
    """Autoescape on for every template (the texts are model outputs); undefined names fail
    loudly rather than print nothing."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("metaloom.eval.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["tokens"] = cells.fmt_tokens
    return env


def _ordered(first: Iterable[Any], seen: Iterable[str]) -> list[str]:
    """``first``'s order (the analysis's), then anything only the records have."""
    out = [str(x) for x in first]
    have = set(out)
    out += [x for x in dict.fromkeys(seen) if x not in have]
    return out


def build_report(out_dir: str, *, analysis: Mapping[str, Any] | None = None, analyze: Analyze | None = None,
                 problems: Iterable[Any] | None = None, merge: Sequence[str] = (),
                 options: Mapping[str, Any] | None = None, exclude: Sequence[str] = ()) -> str:
    """The report of DIR as one HTML string. ``analysis``: the dict of
    `metaloom.eval.analysis.analyze` over DIR's records (computed with ``analyze``, default
    that function with ``options``, when not given); ``problems``: prompts and references (see
    the module); ``merge``: other sweep folders of the same task read with DIR's
    (`load.merge_sweeps`: each model's strategies labelled with it); ``exclude``: leave out the
    strategies whose spec (label) contains any of these texts."""
    sweep = load.load_sweep(out_dir)
    if merge:
        sweep = load.merge_sweeps([sweep, *(load.load_sweep(d) for d in merge)])
    if exclude:
        sweep = load.without(sweep, exclude)
    if analysis is None:
        from metaloom.eval.analysis.select import sweep_seed

        # the sweep's seed: the selection half is the one `metaloom eval --select` chose on
        analysis = analyze(sweep.records) if analyze else default_analyze(sweep.records, sweep_seed(sweep.config),
                                                                           **(options or {}))
    recorded = [str(p) for p in sweep.config.get("problems") or () if isinstance(p, str | int)]
    problem_ids = _ordered(analysis.get("problems") or (), [*recorded, *(r.problem for r in sweep.records)])
    strategies = _ordered(analysis.get("strategies") or (), (r.strategy for r in sweep.records))
    by_problem: dict[str, dict[str, Record]] = {}
    for r in sweep.records:
        by_problem.setdefault(r.problem, {})[r.strategy] = r
    info, prompts_note = load.load_problems(sweep, problems)
    traces = load.read_traces(out_dir, sweep.records)
    text_cap = drilldown.candidate_text_cap(sweep.records)
    problem_list = drilldown.problem_views(problem_ids, strategies, by_problem, info, analysis.get("votes") or {}, traces,
                                           text_cap)
    trees = [{**t, "problem": p["id"], "strategy": rec["strategy"]} for p in problem_list for rec in p["records"]
             for t in rec["trees"]]
    page = _environment().get_template("report.html.j2").render(
        header=views.header_view(sweep, problem_ids, strategies),
        summary=views.summary_rows(sweep.records, strategies, views.points_by_label(analysis)),
        figures=views.figures_view(analysis), frontier=views.frontier_view(analysis),
        scaling=coverage.coverage_fit_view(analysis),
        equal=views.equal_compute_view(analysis),
        selection=views.selection_view(analysis), votes=views.votes_summary(analysis, by_problem, strategies),
        scorers=views.scorers_view(analysis),
        problems=problem_list, trees=trees, prompts_note=prompts_note,
        caps={"text": text_cap, "full_text": cells.TEXT_CAP, "budget": drilldown.PAGE_TEXT_BUDGET,
              "candidates": drilldown.CANDIDATE_CAP, "nodes": drilldown.TREE_NODE_CAP},
    )
    return page


def write_report(out_dir: str, *, path: str | None = None, analysis: Mapping[str, Any] | None = None,
                 analyze: Analyze | None = None, problems: Iterable[Any] | None = None, merge: Sequence[str] = (),
                 options: Mapping[str, Any] | None = None, exclude: Sequence[str] = ()) -> str:
    """Write the report (default ``DIR/report.html``) and return its path (``merge``,
    ``options``, ``exclude``: `build_report`'s). Written to a temporary file first and renamed: a report
    open in a browser is never half a page."""
    page = build_report(out_dir, analysis=analysis, analyze=analyze, problems=problems, merge=merge, options=options,
                        exclude=exclude)
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
