"""The sweep progress bar's time left (issue 30: it sat at 0:00:01-0:00:10 for minutes with
pairs remaining): the pace of this process's finished pairs times the pairs remaining, on a
fake clock."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from metaloom.eval.progress import Pace, SweepProgress, fmt_left, time_left
from metaloom.eval.records import Record


def rec(problem: str, seconds: float = 0.1) -> Record:
    return Record(problem, "greedy", None, True, 1.0, "", {"output_tokens": 1, "flops": 1.0}, seconds)


def test_time_left_is_the_pace_so_far_times_the_pairs_remaining() -> None:
    assert time_left(Pace(100.0), 130.0, 8) is None  # nothing finished here yet: no pace
    assert time_left(Pace(100.0, 2), 120.0, 8) == pytest.approx(80.0)  # 10 s a pair, 8 left
    # 4 pairs in flight, 40 s each: 4 finish at 40 s, so 10 s a pair -- concurrency included
    assert time_left(Pace(0.0, 4), 40.0, 12) == pytest.approx(120.0)
    # no pair finishes for a minute: the estimate grows, it does not count down to zero
    assert time_left(Pace(100.0, 2), 180.0, 8) == pytest.approx(320.0)
    assert time_left(Pace(100.0, 2), 180.0, 0) == 0.0
    assert Pace(5.0).one_more().one_more() == Pace(5.0, 2)
    assert fmt_left(None) == "-:--:--" and fmt_left(320.0) == "0:05:20" and fmt_left(3 * 3600 + 61.4) == "3:01:01"


def test_the_bar_shows_the_time_left_at_the_process_pace_on_a_fake_clock() -> None:
    now = [1000.0]
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    # two pairs recorded by an earlier run: counted in the bar, not in the pace
    bar = SweepProgress([rec("a"), rec("b")], 12, console=console, clock=lambda: now[0])
    try:
        assert bar.left() == "-:--:--"
        # a burst: two pairs (replayed pools) land within a second, then a slow pair runs
        now[0] += 0.5
        bar.add(rec("c"))
        now[0] += 0.5
        bar.add(rec("d"))
        assert bar.left() == "0:00:04"  # 0.5 s a pair so far, 8 left
        now[0] += 300  # five minutes with no pair finished
        assert bar.left() == "0:20:04"  # (301 s / 2 pairs) x 8: not stuck at a few seconds
        column = bar.progress.columns[-1]
        assert str(column.render(bar.progress.tasks[0])) == "0:20:04"  # what the bar draws, each redraw
        now[0] += 100
        for p in "efghijkl":
            bar.add(rec(p))
        assert bar.left() == "0:00:00"  # all 12 done
        assert bar.progress.tasks[0].completed == 12
    finally:
        bar.close()
