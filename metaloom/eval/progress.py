"""The sweep's progress bar (rich): runs done of all, accuracy so far, tokens and FLOPs spent,
and the time left at the current pace.

The time left is `time_left`: this process's wall time per finished pair (pairs in flight at
once finish that much faster) times the pairs remaining. rich's own column divided by the
speed of the last 30 s of advances: a burst of quick pairs (replayed pools, a Ray batch
landing at once) left it at a few seconds for minutes while slow pairs ran.
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from metaloom.eval.records import Record


def _flops(v: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}FLOP"
    return f"{v:.0f} FLOP"


@dataclass(frozen=True)
class Pace:
    """This process's pace: when it started running pairs (``started``, on the bar's clock)
    and how many it has finished since."""

    started: float
    finished: int = 0

    def one_more(self) -> Pace:
        return replace(self, finished=self.finished + 1)


def time_left(pace: Pace, now: float, remaining: int) -> float | None:
    """Seconds left: (``now`` − started) / pairs finished × ``remaining``. With c pairs in
    flight, each taking T, pairs finish every T/c: the elapsed time per finished pair is that
    pace, concurrency included. The wait since the last finished pair counts, so while slow
    pairs run the estimate grows rather than counting down to zero. 0 when nothing remains;
    None before this process has finished a pair (no pace yet)."""
    if remaining <= 0:
        return 0.0
    if pace.finished <= 0:
        return None
    return max(0.0, now - pace.started) / pace.finished * remaining


def fmt_left(seconds: float | None) -> str:
    """``H:MM:SS`` (rich's style), ``-:--:--`` while unknown."""
    return "-:--:--" if seconds is None else str(dt.timedelta(seconds=round(seconds)))


class TimeLeftColumn(ProgressColumn):
    """The time left, computed each time the bar is drawn (rich redraws it several times a
    second), so it keeps growing while no pair finishes."""

    def __init__(self, left: Callable[[], str]) -> None:
        super().__init__()
        self.left = left

    def render(self, task: Task) -> Text:
        return Text(self.left(), style="progress.remaining")


class SweepProgress:
    """``add(record)`` for each record written; the figures count the records already in the
    directory too, the pace only this process's. ``clock``: seconds (tests pass a fake)."""

    def __init__(self, done: Iterable[Record], total: int, *, console: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.records = list(done)
        self.total = total
        self.clock = clock
        self.pace = Pace(clock())
        self.progress = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                                 TimeLeftColumn(self.left), console=console or Console(file=sys.stderr),
                                 transient=False, get_time=clock)
        self.task = self.progress.add_task("eval", total=total, completed=len(self.records), stats=self._stats())
        self.progress.start()

    def _stats(self) -> str:
        n = len(self.records)
        if not n:
            return "runs: 0"
        correct = sum(r.correct for r in self.records)
        tokens = sum(int(r.usage.get("output_tokens") or 0) for r in self.records)
        flops = sum(float(r.usage.get("flops") or 0.0) for r in self.records)
        errors = sum(r.error is not None for r in self.records)
        problems = len({r.problem for r in self.records})
        return (f"problems {problems} · accuracy {correct / n:.1%} · {tokens:,} tokens · {_flops(flops)}"
                + (f" · {errors} errors" if errors else ""))

    def left(self) -> str:
        """The time left now, formatted (`time_left`)."""
        return fmt_left(time_left(self.pace, self.clock(), self.total - len(self.records)))

    def add(self, record: Record) -> None:
        self.records.append(record)
        self.pace = self.pace.one_more()
        self.progress.update(self.task, advance=1, stats=self._stats())

    def close(self) -> None:
        self.progress.stop()
