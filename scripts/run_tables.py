"""The tables of a `metaloom eval` sweep as Markdown, for a closing note or a README: what the
HTML report shows, in text. Reads only DIR/records.jsonl (no model).

    .venv/bin/python scripts/run_tables.py runs/gsm            # every table
    .venv/bin/python scripts/run_tables.py runs/gsm --complete # only problems every strategy has
    .venv/bin/python scripts/run_tables.py runs/gsm --complete --exclude scorer=judge --exclude scorer=rollout

Tables: each strategy at its full size (accuracy with a bootstrap 95% interval, mean output
tokens, TFLOP and seconds per problem); each sampling curve at N = 1, 2, 4, ... (accuracy, and
coverage, the pass@N); each single-run strategy against each curve at equal FLOPs; the
compute-optimal rows on the held-out half; how well each scoring strategy ranks its own
candidates. ``--exclude TEXT`` leaves out the strategies whose spec contains TEXT (before
``--complete`` is applied), to read part of a sweep that grew.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from metaloom.eval.analysis import analyze, pick_for_budget, sweep_seed
from metaloom.eval.analysis.curves import latest
from metaloom.eval.records import Record, read_records


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def tflop(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e12:.3f}"


def interval(lo: float | None, hi: float | None) -> str:
    return "—" if lo is None or hi is None else f"[{100 * lo:.1f}, {100 * hi:.1f}]"


def complete_only(records: Sequence[Record], specs: Sequence[str]) -> list[Record]:
    """The records of the problems that every one of ``specs`` (the sweep's strategies, from its
    config.json) has finished."""
    table = latest(records)
    problems = {p for p, _ in table}
    done = {p for p in problems if all((p, s) in table for s in specs)}
    return [r for r in records if r.problem in done]


def strategies_table(a: dict[str, Any]) -> list[str]:
    lines = ["| strategy | problems | accuracy [95%] | output tokens | TFLOP | seconds |", "|---|---|---|---|---|---|"]
    # every strategy as it ran (a pooled curve's smaller N are subsets, shown under Curves)
    ran = [p for curve in a["curves"] for p in curve["points"] if p["label"] == p["spec"]]
    for top in ran:
        lines.append(f"| {top['label']} | {top['problems']} | {pct(top['accuracy'])} "
                     f"{interval(top['accuracy_lo'], top['accuracy_hi'])} | {top['output_tokens']:.0f} | "
                     f"{tflop(top['flops'])} | {top['seconds']:.1f} |")
    return lines


def curves_table(a: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for curve in a["curves"]:
        pts = [p for p in curve["points"] if p["k"] is not None]
        if len(pts) < 2:
            continue
        lines += [f"\n**{curve['family']}**\n", "| N | accuracy [95%] | coverage | TFLOP |", "|---|---|---|---|"]
        for p in pts:
            lines.append(f"| {p['k']} | {pct(p['accuracy'])} {interval(p['accuracy_lo'], p['accuracy_hi'])} | "
                         f"{pct(p['coverage'])} | {tflop(p['flops'])} |")
    return lines


def equal_table(a: dict[str, Any]) -> list[str]:
    lines = ["| strategy | curve | problems | accuracy | TFLOP | curve there | difference [95%] |",
             "|---|---|---|---|---|---|---|"]
    for e in a["equal_compute"]:
        if e["reason"]:
            diff = e["reason"]
        else:
            diff = (f"{100 * e['difference']:+.1f} [{100 * e['difference_lo']:+.1f}, "
                    f"{100 * e['difference_hi']:+.1f}]")
        lines.append(f"| {e['strategy']} | {e['family']} | {e['problems']} | {pct(e['accuracy'])} | "
                     f"{tflop(e['cost'])} | {pct(e['family_accuracy'])} | {diff} |")
    return lines


def selection_table(a: dict[str, Any]) -> list[str]:
    sel = a["selection"]
    if sel is None:
        return [a.get("selection_reason", "no selection")]
    lines = [f"selection half {len(sel['selection_problems'])} problems, held-out half "
             f"{len(sel['heldout_problems'])}; budget metric {sel['budget_metric']}\n",
             "| budget | policy | compute-optimal | its choice | best single | majority vote | best-of-N "
             "| efficiency vs majority / best-of-N |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sel["rows"]:
        choice = "; ".join(f"{b}: {c}" for b, c in r["choices"].items())
        eff = " / ".join("—" if r.get(k) is None else f"{r[k]:.2f}×"
                         for k in ("efficiency_vs_majority", "efficiency_vs_best_of_n"))
        budget = tflop(r["budget"]) if sel["budget_metric"] == "flops" else f"{r['budget']:.0f}"
        lines.append(f"| {budget} | {r['policy']} | {pct(r['accuracy'])} | {choice} | {pct(r['best_single'])} | "
                     f"{pct(r.get('majority_vote'))} | {pct(r.get('best_of_n'))} | {eff} |")
    if sel["rows"]:
        chosen = pick_for_budget(sel)  # the rule `metaloom eval --select` and the report use
        lines.append(f"\npick (`metaloom eval --select`, largest budget): {chosen.strategy}, held-out accuracy "
                     f"{pct(chosen.heldout_accuracy)}")
    return lines


def scorers_table(a: dict[str, Any]) -> list[str]:
    lines = ["| strategy | problems | mixed | AUROC | its pick | random pick |", "|---|---|---|---|---|---|"]
    for r in a["scorers"]:
        auroc = "—" if r["auroc"] is None else f"{r['auroc']:.2f}"
        lines.append(f"| {r['strategy']} | {r['problems']} | {r['mixed']} | {auroc} | {pct(r['accuracy'])} | "
                     f"{pct(r['random'])} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="the directory `metaloom eval --out` wrote")
    p.add_argument("--complete", action="store_true", help="only the problems every strategy has finished")
    p.add_argument("--exclude", action="append", default=[], metavar="TEXT",
                   help="leave out the strategies whose spec contains TEXT (repeatable)")
    args = p.parse_args(argv)

    def kept(spec: str) -> bool:
        return not any(t in spec for t in args.exclude)

    records = [r for r in read_records(f"{args.dir}/records.jsonl") if kept(r.strategy)]
    with open(f"{args.dir}/config.json") as f:
        config = json.load(f)
    if args.complete:
        records = complete_only(records, [s for s in config["strategies"] if kept(s)])
    a = analyze(records, seed=sweep_seed(config))  # the sweep's seed: the split --select and the report use
    print(f"# {args.dir}: {len(a['problems'])} problems, {len(a['strategies'])} strategies\n")
    print("Accuracy (as in `metaloom eval`'s summary and its report): a sampling strategy's is its expected accuracy "
          "over the order of its samples (a vote's tie goes to the answer seen first); any other's is what it answered.\n")
    for title, part in (("Strategies at full size", strategies_table), ("Curves", curves_table),
                        ("At equal compute (FLOPs)", equal_table), ("Compute-optimal, held-out half", selection_table),
                        ("Scorers: ranking their own candidates (problems with right and wrong ones)", scorers_table)):
        print(f"## {title}\n")
        print("\n".join(part(a)))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
