"""The tables of docs/results.md and runs/<finding>/README.md, printed in Markdown from the
committed records (no model): every figure there is re-rendered by this script.

    .venv/bin/python runs/results_tables.py coverage runs/coverage/countdown runs/gsm
    .venv/bin/python runs/results_tables.py compute_optimal runs/coverage/countdown [--difficulty pass_rate]
    .venv/bin/python runs/results_tables.py small_vs_large runs/game24 runs/small_vs_large/game24-1.5b
    .venv/bin/python runs/results_tables.py figure REPORT.html "ALT TEXT PREFIX" OUT.png  # one figure of a report

Accuracy is `metaloom eval`'s and the report's (`metaloom.eval.analysis`): a sampling strategy's
is its exact expected accuracy over the order of its samples; intervals are percentile bootstrap
95% over problems (1000 resamples, the sweep's seed). Only the problems every strategy of the
folder finished are read (a sweep stopped midway is read on the problems it completed).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from metaloom.eval.analysis import analyze, sweep_seed
from metaloom.eval.analysis.curves import latest
from metaloom.eval.records import Record, read_records
from metaloom.eval.report.load import load_sweep, merge_sweeps
from metaloom.wiring.spec import parse_spec


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def ci(lo: float | None, hi: float | None) -> str:
    return "" if lo is None or hi is None else f" [{100 * lo:.1f}, {100 * hi:.1f}]"


def tflop(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e12:.2f}"


def complete(records: Sequence[Record], exclude: Sequence[str] = ()) -> list[Record]:
    """The records of the problems every (non-excluded) strategy finished."""
    table = latest([r for r in records if not any(e in r.strategy for e in exclude)])
    specs = {s for _, s in table}
    problems = {p for p, _ in table}
    done = {p for p in problems if all((p, s) in table for s in specs)}
    return [r for r in table.values() if r.problem in done]


def seed_of(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        return sweep_seed(json.load(f))


def coverage(folders: Sequence[str], exclude: Sequence[str]) -> list[str]:
    out = []
    for folder in folders:
        recs = complete(list(read_records(os.path.join(folder, "records.jsonl"))), exclude)
        a = analyze(recs, seed=seed_of(folder))
        fits = {f["spec"]: f for f in a["coverage_fit"]}
        problems = len({r.problem for r in recs})
        out.append(f"\n**{folder}** ({problems} problems)\n")
        curves = {c["family"]: {p["k"]: p for p in c["points"]} for c in a["curves"]}
        pooled = [f for f, pts in curves.items() if any(k is not None for k in pts)]
        for spec, fit in fits.items():
            if fit["a"] is None:
                out.append(f"{spec}: no power-law fit ({fit['reason']})\n")
                continue
            out.append(f"Fit of {spec}'s pool: log coverage = a·k^b, a = {fit['a']:.3f}{ci2(fit['a_lo'], fit['a_hi'])}, "
                       f"b = {fit['b']:.3f}{ci2(fit['b_lo'], fit['b_hi'])}; RMS residual {100 * fit['rms']:.2f} points "
                       f"({fit['rms_log']:.3f} in log coverage).\n")
            head = "| k | coverage [95%] | fit | residual | " + " | ".join(pooled) + " | TFLOP |"
            out += [head, "|" + "---|" * (5 + len(pooled))]
            first = curves[pooled[0]]
            for i, k in enumerate(fit["k"]):
                p0 = first.get(k, {})
                at = [curves[f].get(k, {}) for f in pooled]
                cells = [f"{pct(q.get('accuracy'))}{ci(q.get('accuracy_lo'), q.get('accuracy_hi'))}" for q in at]
                out.append(f"| {k} | {pct(fit['coverage'][i])}{ci(p0.get('coverage_lo'), p0.get('coverage_hi'))} | "
                           f"{pct(fit['fitted'][i])} | {100 * fit['residual'][i]:+.2f} | " + " | ".join(cells)
                           + f" | {tflop(p0.get('flops'))} |")
        singles = [p for c in a["curves"] for p in c["points"] if p["k"] is None]
        for p in singles:
            out.append(f"\n{p['label']}: {pct(p['accuracy'])}{ci(p['accuracy_lo'], p['accuracy_hi'])}, "
                       f"{tflop(p['flops'])} TFLOP")
    return out


def ci2(lo: float | None, hi: float | None) -> str:
    return "" if lo is None or hi is None else f" [{lo:.3f}, {hi:.3f}]"


def selection(folder: str, difficulty: str, bins: int, exclude: Sequence[str]) -> list[str]:
    recs = complete(list(read_records(os.path.join(folder, "records.jsonl"))), exclude)
    a = analyze(recs, seed=seed_of(folder), difficulty=difficulty, bins=bins)
    sel = a["selection"]
    if not sel:
        return [f"no selection: {a.get('selection_reason')}"]
    bin_names = [b["name"] for b in sel["bins"]]
    bins_text = ", ".join(f"{b['name']} ({len(b['problems'])}" + ("" if b["max_difficulty"] is None else
                                                                f", difficulty <= {b['max_difficulty']:.3g}") + ")"
                          for b in sel["bins"])
    out = [f"{len(sel['selection_problems'])} selection / {len(sel['heldout_problems'])} held-out problems; bins "
           f"{bins_text}; probe: {sel['probe']}\n",
           "| budget TFLOP | " + " | ".join(bin_names) + " | policy | compute-optimal [95%] | majority vote | "
           "− majority vote [95%] | best-of-N | − best-of-N [95%] | majority needs × | best-of-N needs × |",
           "|" + "---|" * (len(bin_names) + 9)]
    for r in sel["rows"]:
        out.append(f"| {tflop(r['budget'])} | " + " | ".join(str(r["choices"].get(b)) for b in bin_names)
                   + f" | {r['policy']} | {pct(r['accuracy'])}{ci(r.get('accuracy_lo'), r.get('accuracy_hi'))} | "
                   f"{pct(r['majority_vote'])} | {points(r, 'majority_vote')} | {pct(r['best_of_n'])} | "
                   f"{points(r, 'best_of_n')} | {times(r.get('efficiency_vs_majority'))} | "
                   f"{times(r.get('efficiency_vs_best_of_n'))} |")
    return out


def points(row: dict, name: str) -> str:
    """Compute-optimal's paired held-out difference from baseline ``name``, in points [95%]."""
    diff = row.get(f"{name}_difference")
    if diff is None:
        return "–"
    lo, hi = row.get(f"{name}_difference_lo"), row.get(f"{name}_difference_hi")
    return f"{100 * diff:+.1f}" + ("" if lo is None or hi is None else f" [{100 * lo:+.1f}, {100 * hi:+.1f}]")


def times(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def small_vs_large(folders: Sequence[str], exclude: Sequence[str]) -> list[str]:
    sweep = merge_sweeps([load_sweep(f) for f in folders])
    recs = complete(sweep.records, exclude)
    a = analyze(recs, seed=sweep_seed(sweep.config))
    a["_records"] = recs
    problems = len({r.problem for r in recs})
    out = [f"{problems} problems every strategy finished\n", "| strategy | accuracy [95%] | TFLOP per problem |",
           "|---|---|---|"]
    for c in a["curves"]:
        for p in c["points"]:
            out.append(f"| {p['label']} | {pct(p['accuracy'])}{ci(p['accuracy_lo'], p['accuracy_hi'])} | {tflop(p['flops'])} |")
    out += ["", *head_to_head(a, seed=sweep_seed(sweep.config))]
    out += ["", "| strategy | curve | its accuracy | curve there | difference [95%] |", "|---|---|---|---|---|"]
    for e in a["equal_compute"]:
        if parse_spec(e["strategy"]).params.get("model") == parse_spec(e["family"]).params.get("model"):
            continue  # one model against itself: the coverage and compute-optimal tables have it
        diff = e["reason"] or (f"{100 * e['difference']:+.1f} [{100 * e['difference_lo']:+.1f}, "
                               f"{100 * e['difference_hi']:+.1f}]")
        out.append(f"| {e['strategy']} | {e['family']} | {pct(e['accuracy'])} | {pct(e['family_accuracy'])} | {diff} |")
    return out


def head_to_head(a: dict, *, seed: int) -> list[str]:
    """Each single-run strategy of one model against each of another's (a search against the
    larger model's greedy): accuracy difference paired per problem, with its bootstrap
    interval, and the FLOPs ratio; over the problems both have."""
    from metaloom.eval.analysis.curves import interval, points

    singles = [p for p in points(a["_records"], seed=seed) if p.k is None]
    model = {p.label: parse_spec(p.label).params.get("model") for p in singles}
    out = ["| strategy | against | problems | difference [95%] | FLOPs ratio |", "|---|---|---|---|---|"]
    for s in singles:
        for o in singles:
            if model[s.label] == model[o.label] or not o.label.startswith("greedy"):
                continue
            shared = [q for q in s.problems if o.covers(q)]
            diff = s.correct[s.among(shared)] - o.correct[o.among(shared)]
            lo, hi = interval(diff, seed=seed)
            ratio = s.mean_cost("flops", shared) / o.mean_cost("flops", shared)
            out.append(f"| {s.label} | {o.label} | {len(shared)} | {100 * diff.mean():+.1f} [{100 * lo:+.1f}, "
                       f"{100 * hi:+.1f}] | {ratio:.2f} |")
    return out


def figure(html: str, alt: str, out: str) -> list[str]:
    """Write the report figure whose alt text starts with ``alt`` (a data URI in the page) to
    ``out`` as PNG, for a README to show without the whole page."""
    import base64
    import re

    with open(html, encoding="utf-8") as f:
        page = f.read()
    found = re.search(r'<img alt="' + re.escape(alt) + r'[^"]*" src="data:image/png;base64,([^"]+)"', page)
    if found is None:
        raise SystemExit(f"no figure whose alt text starts with {alt!r} in {html}")
    with open(out, "wb") as f:
        f.write(base64.b64decode(found.group(1)))
    return [out]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("finding", choices=("coverage", "compute_optimal", "small_vs_large", "figure"))
    p.add_argument("folders", nargs="+")
    p.add_argument("--difficulty", default="pass_rate")
    p.add_argument("--bins", type=int, default=3)
    p.add_argument("--exclude", action="append", default=[], help="leave out strategies whose spec contains TEXT")
    args = p.parse_args(argv)
    if args.finding == "coverage":
        lines = coverage(args.folders, args.exclude)
    elif args.finding == "compute_optimal":
        lines = [x for f in args.folders for x in [f"\n**{f}**\n", *selection(f, args.difficulty, args.bins, args.exclude)]]
    elif args.finding == "figure":  # folders: HTML, ALT text prefix, OUT.png
        lines = figure(*args.folders)
    else:
        lines = small_vs_large(args.folders, args.exclude)
    print("\n".join(lines))


if __name__ == "__main__":
    main()


