"""Benchmark timing helpers."""

import time

from metaloom.bench.timing import paired_median_seconds


def test_paired_median_seconds_alternates_and_takes_each_median():
    calls: list[str] = []
    delays = {"a": [0.0, 0.0, 0.03, 0.0], "b": [0.0, 0.02, 0.02, 0.05]}  # warm-up first, then 3 repeats

    def fn(name):
        def run():
            calls.append(name)
            time.sleep(delays[name][sum(c == name for c in calls) - 1])
        return run

    a, b = paired_median_seconds([fn("a"), fn("b")], repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4  # warm-up round, then A B in every repeat
    assert a < 0.015  # median of (0, 0.03, 0): the one slow repeat does not count
    assert 0.015 < b < 0.045  # median of (0.02, 0.02, 0.05)
