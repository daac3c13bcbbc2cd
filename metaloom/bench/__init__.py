"""Benchmarks: side by side in one run, medians over repeats after a warm-up, ratios.
Registered by name for `metaloom bench NAME`."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _decode(args: argparse.Namespace) -> int:
    from metaloom.bench.decode import main

    return main(args)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], int]] = {"decode": _decode}


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128, help="batch-1 greedy length")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens per sample in the n-samples case")
    p.add_argument("--json", action="store_true")
