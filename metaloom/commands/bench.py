"""`metaloom bench NAME`: benchmarks registered in `metaloom.bench.BENCHMARKS`."""

from __future__ import annotations

import argparse

from metaloom.bench import BENCHMARKS, add_bench_args


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks (side by side in one run)")
    b.add_argument("which", choices=sorted(BENCHMARKS))
    add_bench_args(b)
    b.set_defaults(run=lambda args: BENCHMARKS[args.which](args))
