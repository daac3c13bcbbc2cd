"""`metaloom report DIR`: one self-contained HTML file for a `metaloom eval` directory
(curves with intervals, frontier, compute-optimal table, vote histograms, drill-down, trees)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="an HTML report of a `metaloom eval` directory")
    r.add_argument("dir", help="the directory `metaloom eval --out` wrote")
    r.add_argument("--output", default=None, help="the HTML file (default: DIR/report.html)")
    r.add_argument("--screenshot", default=None, metavar="PNG", help="also render the whole page with headless Chromium to PNG")
    r.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from metaloom.eval.report import write_report

    path = write_report(args.dir, path=args.output)
    print(path)
    if args.screenshot:
        from metaloom.eval.report.screenshot import screenshot

        print(screenshot(path, args.screenshot))
    return 0
