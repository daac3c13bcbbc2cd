"""`metaloom report` of a small model's sweep beside a larger one's, on the problems every strategy
of both finished (issue 49's small-vs-large figure; no model is run).

    .venv/bin/python runs/small_vs_large/report.py runs/small_vs_large/report-game24.html \
        runs/game24 runs/small_vs_large/game24-1.5b --screenshot runs/small_vs_large/report-game24.png

`metaloom report SMALL --with LARGE` reads each strategy on the problems it has: the 0.5B's
searches on 40 puzzles, the 1.5B's votes on the 9 its sweep has finished, and its accuracy
figure draws the 1.5B's points hollow (measured on other problems). Here both sweeps are first
copied, records and config, restricted to the problems every strategy finished (the rows of
`runs/results_tables.py small_vs_large`), traces linked, and the report is written from the
copies, so the page's figures and tables are that table's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from results_tables import complete  # runs/results_tables.py: the tables' problem set

from metaloom.eval.report import write_report
from metaloom.eval.report.load import load_sweep, merge_sweeps


def restricted_copy(folder: str, problems: set[str], into: str, exclude: Sequence[str] = ()) -> str:
    """``folder``'s config and records on ``problems`` only (and none of a strategy whose spec
    contains a text of ``exclude``), in ``into``/<folder's name>, with its traces linked and its
    records file's time (the page's "written")."""
    out = os.path.join(into, os.path.basename(os.path.normpath(folder)))
    os.makedirs(out)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["problems"] = [p for p in config.get("problems") or () if p in problems]
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    src = os.path.join(folder, "records.jsonl")
    with open(src, encoding="utf-8") as f, open(os.path.join(out, "records.jsonl"), "w", encoding="utf-8") as g:
        g.writelines(line for line in f if line.strip() and kept(json.loads(line), problems, exclude))
    stamp = os.path.getmtime(src)
    os.utime(os.path.join(out, "records.jsonl"), (stamp, stamp))
    if os.path.isdir(os.path.join(folder, "traces")):
        os.symlink(os.path.abspath(os.path.join(folder, "traces")), os.path.join(out, "traces"))
    return out


def kept(record: dict, problems: set[str], exclude: Sequence[str]) -> bool:
    return record.get("problem") in problems and not any(t in str(record.get("strategy")) for t in exclude)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("output", help="the HTML file to write")
    p.add_argument("folders", nargs="+", help="the small model's sweep, then the larger ones' (`--with`)")
    p.add_argument("--screenshot", default=None, metavar="PNG", help="also render the page to PNG (headless Chromium)")
    p.add_argument("--exclude", action="append", default=[], help="leave out strategies whose spec contains TEXT")
    args = p.parse_args(argv)
    merged = merge_sweeps([load_sweep(f) for f in args.folders])
    problems = {r.problem for r in complete(merged.records, args.exclude)}
    with tempfile.TemporaryDirectory(prefix="metaloom-small-vs-large-") as tmp:
        copies = [restricted_copy(f, problems, tmp, args.exclude) for f in args.folders]
        path = write_report(copies[0], path=args.output, merge=copies[1:])
        print(f"{path}: {len(problems)} problems every strategy finished")
        if args.screenshot:
            from metaloom.eval.report.screenshot import screenshot

            print(screenshot(path, args.screenshot))


if __name__ == "__main__":
    main()
