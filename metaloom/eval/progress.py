"""The sweep's progress bar (rich): runs done of all, accuracy so far, tokens and FLOPs spent,
and the time left at the current pace."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from metaloom.eval.records import Record


def _flops(v: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if v >= scale:
            return f"{v / scale:.1f} {unit}FLOP"
    return f"{v:.0f} FLOP"


class SweepProgress:
    """``add(record)`` for each record written; the figures count the records already in the
    directory too, the pace only this process's."""

    def __init__(self, done: Iterable[Record], total: int, *, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.records = list(done)
        self.progress = Progress(TextColumn("[bold]eval"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                                 TimeRemainingColumn(), console=console or Console(file=sys.stderr), transient=False)
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

    def add(self, record: Record) -> None:
        self.records.append(record)
        self.progress.update(self.task, advance=1, stats=self._stats())

    def close(self) -> None:
        self.progress.stop()
