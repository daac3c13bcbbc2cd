"""The sweep's output: ``DIR/config.json`` (what was asked: task config, strategy specs, model,
sampling seed), ``DIR/records.jsonl`` (one `Record` per (problem, strategy spec), appended as
each finishes) and ``DIR/traces/`` (a tree-search run's tree, one JSON file per record that
has one).

A record of a **sampling strategy** (`POOLED`: majority vote, weighted vote, best-of-N, MBR)
keeps every candidate with its own cost, so curves for smaller N are drawn by subsampling the
largest N instead of sampling again (`metaloom.eval.pool`): ``candidates[i]`` has its tokens,
its share of FLOPs and seconds, its extracted answer, its grade and its score; ``shared`` is
what no single sample caused (the prompt's prefill, scorer calls over the whole set), and
``selection`` says how the strategy picks (enough to re-pick among any subset).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter

CONFIG = "config.json"
RECORDS = "records.jsonl"
TRACES = "traces"
POOLS = "pools"  # each problem's sample pools (`metaloom.eval.replay`)
POOLED = ("majority_vote", "weighted_vote", "best_of_n", "mbr")


@dataclass(frozen=True)
class Candidate:
    """One sample of a pooled strategy: ``tokens`` generated, the ``flops``, ``seconds`` and
    ``kv_bytes`` (its share of the run's peak KV memory) attributed to it (its own decode
    steps; see `metaloom.eval.pool`), its extracted
    ``answer``, whether it is ``correct``, and the strategy's ``score`` for it (None where the
    strategy does not score). ``text`` is kept for the report's drill-down."""

    text: str
    tokens: int
    flops: float | None  # None: the run could not count FLOPs (a remote server)
    seconds: float
    answer: str | None
    correct: bool
    score: float | None = None
    kv_bytes: float | None = None  # None: unknown (a remote server; a record written before it was measured)


@dataclass(frozen=True)
class Selection:
    """How a pooled strategy picks, enough to re-pick within any subset of its candidates:
    ``kind`` (a `POOLED` name); for votes, ``groups[i]``: candidate i's answer class (None:
    no answer, no vote) and ``transform`` (weighted vote's "identity" or "exp"); for MBR,
    ``groups[i]``: the index of candidate i's text among the distinct texts and ``matrix``:
    the utility of distinct text a against b."""

    kind: str
    groups: tuple[int | None, ...] = ()
    transform: str | None = None
    matrix: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True)
class Record:
    """One (problem, strategy spec) run. ``answer``/``correct``/``score``: the grade of the
    chosen output ``best``; ``usage``: `Usage.to_dict()` of the whole run; ``stopped_reason``:
    the strategy's (None, "budget", ...); ``trace``: the file under ``traces/`` holding the
    run's search tree events, or None; ``error``: set when the run failed (then the run is
    graded incorrect and keeps what it cost). Pooled strategies add ``candidates``,
    ``shared`` (usage fields no single sample caused) and ``selection``."""

    problem: str
    strategy: str
    answer: str | None
    correct: bool
    score: float
    best: str
    usage: Mapping[str, Any]
    seconds: float
    stopped_reason: str | None = None
    trace: str | None = None
    error: str | None = None
    candidates: tuple[Candidate, ...] = ()
    shared: Mapping[str, float | None] = field(default_factory=dict)
    selection: Selection | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.problem, self.strategy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Record:
        sel = d.get("selection")
        selection = None if sel is None else Selection(
            kind=sel["kind"], groups=tuple(sel.get("groups") or ()), transform=sel.get("transform"),
            matrix=tuple(tuple(row) for row in sel.get("matrix") or ()))
        return Record(problem=d["problem"], strategy=d["strategy"], answer=d.get("answer"), correct=bool(d["correct"]),
                      score=float(d.get("score", float(d["correct"]))), best=d.get("best", ""), usage=d.get("usage", {}),
                      seconds=float(d.get("seconds", 0.0)), stopped_reason=d.get("stopped_reason"),
                      trace=d.get("trace"), error=d.get("error"),
                      candidates=tuple(Candidate(**c) for c in d.get("candidates") or ()),
                      shared=d.get("shared") or {}, selection=selection)


def read_records(path: str) -> Iterator[Record]:
    """The records of a ``records.jsonl``; a line that is not a record (a write cut off by a
    crash is the last line) is an `InvalidParameter` naming the line, except a last line
    without its newline, which is skipped (the run it described is redone)."""
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if number == len(lines) and not line.endswith("\n"):
            return
        try:
            yield Record.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidParameter("records", f"{path}:{number}", f"a record as `metaloom eval` writes it ({exc})") from exc
