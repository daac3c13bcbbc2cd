"""Timing helpers shared by benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work (kernels run asynchronously: a timer read without this measures
    only the launches). A no-op on CPU."""
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   device: torch.device | str | None = None) -> float:
    return paired_median_seconds([fn], repeats, warmup, device)[0]


def paired_median_seconds(fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 1,
                          device: torch.device | str | None = None) -> list[float]:
    """Median seconds of each of ``fns``, run in turn within every repeat (A B A B ...) after
    ``warmup`` rounds, so load that drifts during the run (a shared host, thermal limits) hits
    every function alike and their ratios stay fair."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """The device's achievable memory bandwidth: a large tensor copy reads and writes every
    byte once, so bytes moved = 2 x size. Best of ``repeats``."""
    a = torch.ones(megabytes * 2**20 // 4, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        b.copy_(a)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * 4 / best / 1e9
