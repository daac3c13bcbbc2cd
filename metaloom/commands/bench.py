"""`metaloom bench NAME`: one subcommand per benchmark in `metaloom.bench.BENCHMARKS`, each
with only its own flags."""

from __future__ import annotations

import argparse
import importlib

from metaloom.bench import BENCHMARKS


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (side by side in one run)")
    which = b.add_subparsers(dest="which", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = which.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_args(p)
        p.set_defaults(run=module.main)
