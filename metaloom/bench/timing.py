"""Timing helpers shared by benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """The machine's achievable memory bandwidth: a large tensor copy reads and writes every
    byte once, so bytes moved = 2 x size. Best of ``repeats``."""
    a = torch.ones(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * 4 / best / 1e9
