"""`metaloom tree FILE.json`: draw the search tree a tree-search strategy left in its trace (the
"tree" event of `metaloom run ... --json`): a header (strategy, aggregation, why it stopped,
nodes by state, tokens), one line per node with the best path marked ★, and the usage of each
round. FILE may hold one run result, a trace (as `metaloom eval` writes to DIR/traces/), a bare
tree event, or JSON Lines of them; `-` reads stdin.
Reading is `metaloom.search.trace`, drawing `metaloom.present.tree`."""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("tree", help="draw the search tree of a tree-search result (metaloom run ... --json)")
    s.add_argument("file", help="a metaloom run --json result, a trace (metaloom eval's DIR/traces/*.json), a tree event, "
                   "or JSON Lines of them; - reads stdin")
    s.add_argument("--width", type=int, default=80, help="cut each step's text to this many characters (0 = no text)")
    s.add_argument("--collapse-pruned", action="store_true", help="show a node's pruned children as one line '… N pruned'")
    s.add_argument("--max-depth", type=int, default=None, metavar="D", help="draw nothing below depth D (the root is 0)")
    s.add_argument("--best-only", action="store_true", help="only the path from the root to the best node")
    s.add_argument("--no-color", action="store_true",
                   help="no colour or bold even on a terminal (a file or a pipe always gets plain text)")
    s.set_defaults(run=run)


def read_input(path: str) -> str:
    from metaloom.errors import InvalidParameter

    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise InvalidParameter("file", path, f"UTF-8 JSON text (byte {exc.start} is not UTF-8)") from None
    except OSError as exc:
        raise InvalidParameter("file", path, f"a readable file ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from metaloom.errors import InvalidParameter
    from metaloom.present.tree import plain_console, print_records
    from metaloom.search.trace import parse_trees

    if args.width < 0:
        raise InvalidParameter("width", args.width, "an integer >= 0 (0 = no step text)")
    if args.max_depth is not None and args.max_depth < 0:
        raise InvalidParameter("max_depth", args.max_depth, "an integer >= 0 (0 = the root only)")
    source = "<stdin>" if args.file == "-" else args.file
    records = parse_trees(read_input(args.file), source)  # every check before the first line printed
    # a terminal: its width (longer lines end in …) and colour; anything else (a file, a pipe,
    # a test's capture): plain text as wide as the widest line. Decided by isatty alone, so
    # FORCE_COLOR and the like never put escape codes in a file.
    terminal = sys.stdout.isatty()
    if terminal:
        console = Console(file=sys.stdout, force_terminal=True, color_system=None if args.no_color else "auto",
                          highlight=False, markup=False, emoji=False, soft_wrap=False)
    else:
        console = plain_console(sys.stdout)
    try:
        print_records(console, records, fit=not terminal, width=args.width, collapse_pruned=args.collapse_pruned,
                      max_depth=args.max_depth, best_only=args.best_only)
        sys.stdout.flush()
    except BrokenPipeError:  # `metaloom tree big.json | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
