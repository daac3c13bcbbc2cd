"""`metaloom report DIR`: one self-contained HTML file for a `metaloom eval` directory
(curves with intervals, the coverage power law, frontier, compute-optimal table, vote
histograms, drill-down, trees). ``--with OTHER`` reads other sweeps of the same task beside it
(each model's strategies labelled with the model); ``--status`` prints where a running sweep
stands instead (``--follow S``: again every S seconds until it is complete)."""

from __future__ import annotations

import argparse
import time

from metaloom.errors import InvalidParameter

DIFFICULTIES = ("agreement", "pass_rate")  # `metaloom.eval.analysis.difficulty.DIFFICULTIES`, without importing it here


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="an HTML report of a `metaloom eval` directory")
    r.add_argument("dir", help="the directory `metaloom eval --out` wrote")
    r.add_argument("--output", default=None, help="the HTML file (default: DIR/report.html)")
    r.add_argument("--screenshot", default=None, metavar="PNG", help="also render the whole page with headless Chromium to PNG")
    r.add_argument("--with", dest="merge", action="append", default=[], metavar="DIR",
                   help="another sweep of the same task to read beside DIR (repeatable): a larger model's votes "
                        "against DIR's searches at equal FLOPs; each model's strategies are labelled model=NAME")
    r.add_argument("--difficulty", default="agreement", choices=DIFFICULTIES,
                   help="how compute-optimal selection bins problems: agreement = answer agreement among the "
                        "first 4 samples (no ground truth, its cost charged); pass_rate = the model's pass rate "
                        "over the whole pool (Snell et al.'s oracle difficulty: reads the ground truth, not charged)")
    r.add_argument("--bins", type=int, default=3, help="difficulty bins for compute-optimal selection")
    r.add_argument("--exclude", action="append", default=[], metavar="TEXT",
                   help="leave out the strategies whose spec contains TEXT (repeatable): a report on part of a sweep")
    r.add_argument("--status", action="store_true",
                   help="print where the sweep in DIR stands (pairs done, accuracy so far, time left, whether a "
                        "metaloom eval is writing it) instead of writing the report")
    r.add_argument("--follow", type=float, default=None, metavar="SECONDS",
                   help="with --status: print it again every SECONDS until the sweep is complete")
    r.set_defaults(run=run)


def _status(args: argparse.Namespace) -> int:
    from metaloom.eval.status import render, sweep_status

    while True:
        status = sweep_status(args.dir)
        print(render(status), flush=True)
        if args.follow is None or status.done >= status.planned:
            return 0
        time.sleep(args.follow)


def run(args: argparse.Namespace) -> int:
    if args.follow is not None and not (args.status and args.follow > 0):
        raise InvalidParameter("follow", args.follow, "seconds > 0, with --status")
    if args.status:
        return _status(args)
    if args.bins < 1:
        raise InvalidParameter("bins", args.bins, "an integer >= 1")
    from metaloom.eval.report import write_report

    path = write_report(args.dir, path=args.output, merge=args.merge, exclude=args.exclude,
                        options={"difficulty": args.difficulty, "bins": args.bins})
    print(path)
    if args.screenshot:
        from metaloom.eval.report.screenshot import screenshot

        print(screenshot(path, args.screenshot))
    return 0
