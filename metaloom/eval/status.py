"""Where a sweep stands, read from its folder while it runs (`metaloom report DIR --status`): a
sweep started in the background (``nohup metaloom eval ... --no-progress &``) can be watched
from another terminal without touching it.

Read only: ``DIR/config.json`` (the planned problems and strategies), ``DIR/records.jsonl``
(what finished) and ``DIR/.lock`` (whether a `metaloom eval` holds the folder now, and who:
`metaloom.eval.lock`, with the strategies that run runs: a strategy of the config the running
sweep does not run is planned at what it has). Per strategy: pairs done of planned, errors, accuracy so far (as the
report defines it: a sampling strategy's expected accuracy over the order of its samples), the
mean seconds a finished pair took. The time left is, per strategy, its remaining pairs times
its own mean seconds (a strategy that has not finished a pair yet: the mean over all finished
pairs), summed: the pairs of a sweep differ by orders of magnitude (greedy against a 64-sample
pool), so one mean over all pairs would mislead. Seconds are each record's wall time, so two
sweeps sharing the CPU each show the pace they actually get.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.lock import LOCK
from metaloom.eval.records import CONFIG, POOLED, RECORDS, Record, read_records


@dataclass(frozen=True)
class Row:
    """One strategy's progress."""

    strategy: str
    done: int
    planned: int
    errors: int
    accuracy: float | None
    seconds: float | None  # mean wall seconds per finished pair


@dataclass(frozen=True)
class Status:
    """A sweep folder's progress: per-strategy `Row`s, the ``holder`` of its lock (None: no
    `metaloom eval` is writing it), when the last record was written, and the estimated
    seconds left (None before any pair has finished)."""

    out: str
    rows: tuple[Row, ...]
    problems: int
    holder: str | None
    last_record: float | None
    seconds_left: float | None

    @property
    def done(self) -> int:
        return sum(r.done for r in self.rows)

    @property
    def planned(self) -> int:
        return sum(r.planned for r in self.rows)


def holder(out: str) -> tuple[str, list[str] | None] | None:
    """Who holds ``out``'s sweep lock ("pid P on HOST, since T") and the strategies that run
    runs (None where the lock does not say), or None when nobody holds it. Probed with a shared
    non-blocking flock, released at once."""
    path = os.path.join(out, LOCK)
    if not os.path.exists(path):
        return None
    try:
        import fcntl
    except ImportError:  # no flock here: nothing can be told
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                with open(path) as f:
                    h = json.load(f)
                running = h.get("strategies")
                return (f"pid {h['pid']} on {h['host']}, since {h['since']}",
                        [str(s) for s in running] if isinstance(running, list) else None)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return "a metaloom eval (holder unknown)", None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _accuracy(records: Sequence[Record]) -> float | None:
    from metaloom.eval.analysis.subsample import outcome
    from metaloom.wiring.spec import parse_spec

    if not records:
        return None
    pooled = parse_spec(records[0].strategy).name in POOLED
    return sum(outcome(r, len(r.candidates) if pooled and r.candidates else None).correct for r in records) / len(records)


def sweep_status(out: str) -> Status:
    """The progress of the sweep in ``out`` (see the module docstring). Not a sweep folder
    (no config.json): `InvalidParameter`."""
    config_path = os.path.join(out, CONFIG)
    if not os.path.isfile(config_path):
        raise InvalidParameter("dir", out, f"a `metaloom eval` output directory ({CONFIG} missing)")
    with open(config_path) as f:
        config: Mapping[str, Any] = json.load(f)
    problems = [str(p) for p in config.get("problems") or ()]
    specs = [str(s) for s in config.get("strategies") or ()]
    held = holder(out)
    # a running sweep plans what its lock says; the config lists every strategy any run asked for
    running = set(held[1]) if held and held[1] else None
    path = os.path.join(out, RECORDS)
    latest = {r.key: r for r in read_records(path)} if os.path.exists(path) else {}
    wanted = set(problems)
    by_spec = {s: [r for (p, t), r in latest.items() if t == s and p in wanted] for s in specs}
    all_seconds = [r.seconds for rs in by_spec.values() for r in rs]
    overall = sum(all_seconds) / len(all_seconds) if all_seconds else None
    rows, left = [], 0.0
    for s in specs:
        rs = by_spec[s]
        mean = sum(r.seconds for r in rs) / len(rs) if rs else None
        planned = len(problems) if running is None or s in running else len(rs)
        rows.append(Row(s, len(rs), planned, sum(r.error is not None for r in rs), _accuracy(rs), mean))
        pace = mean if mean is not None else overall
        left += (planned - len(rs)) * (pace or 0.0)
    return Status(out, tuple(rows), len(problems), held[0] if held else None,
                  os.path.getmtime(path) if latest else None, left if overall is not None else None)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render(status: Status, now: float | None = None) -> str:
    """The status as text: a headline, then one line per strategy."""
    now = time.time() if now is None else now
    state = f"running ({status.holder})" if status.holder else "not running"
    last = "none yet" if status.last_record is None else f"{_clock(now - status.last_record)} ago"
    untimed = sum(r.done == 0 < r.planned for r in status.rows)
    note = f" ({untimed} strategies not timed yet, counted at the mean pair so far)" if untimed and status.done else ""
    lines = [f"{status.out}: {status.done}/{status.planned} pairs over {status.problems} problems, {state}; "
             f"last record {last}; time left at this pace {_clock(status.seconds_left)}{note}"]
    width = max((len(r.strategy) for r in status.rows), default=8)
    for r in status.rows:
        acc = "–" if r.accuracy is None else f"{100 * r.accuracy:.1f}%"
        secs = "–" if r.seconds is None else f"{r.seconds:.1f} s"
        lines.append(f"  {r.strategy:<{width}}  {r.done:>4}/{r.planned:<4}  accuracy {acc:>6}  {secs:>9} a pair"
                     + (f"  errors {r.errors}" if r.errors else ""))
    return "\n".join(lines)
