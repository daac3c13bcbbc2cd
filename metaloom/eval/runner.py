"""Run a sweep: every (problem, strategy spec) pair once, each record appended to
``DIR/records.jsonl`` as it finishes (`metaloom.eval.records`).

The driver (`run_sweep`) owns the directory: it checks the configuration against what ``DIR``
already holds, skips the pairs already recorded, writes each trace file before the record
that names it (a crash leaves no record pointing at nothing), and drops a last line a crash
cut short. The work itself is `metaloom.eval.worker.execute(setup, job)`: plain data in, plain
data out, so an executor can run it here (`local_executor`) or in a Ray worker
(`metaloom.eval.ray_executor`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.lock import LOCK, sweep_lock
from metaloom.eval.records import CONFIG, POOLED, POOLS, RECORDS, TRACES, Record, read_records
from metaloom.eval.tasks.base import Problem
from metaloom.eval.worker import Job, Outcome, Setup, execute
from metaloom.wiring.spec import check_spec

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Sweep:
    """A checked sweep: its setup, canonical specs, problems and output directory."""

    setup: Setup
    specs: tuple[str, ...]
    problems: tuple[Problem, ...]
    task_config: Mapping[str, Any]
    out: str

    def config(self) -> dict[str, Any]:
        return {"task": dict(self.task_config), "setup": self.setup.identity(), "strategies": list(self.specs),
                "problems": [p.id for p in self.problems]}


def plan_sweep(setup: Setup, specs: Sequence[str], out: str) -> Sweep:
    """Check everything that can be checked before a model loads: the task (and its file),
    the limit, each spec's names, parameters and types."""
    from metaloom.eval.tasks import make_task

    if not specs:
        raise InvalidParameter("strategies", specs, "at least one strategy spec (NAME or NAME@param=v,...)")
    canonical: list[str] = []
    for s in specs:
        spec = check_spec(s, "strategies")
        if spec.name in POOLED and spec.budget_items():
            raise InvalidParameter(f"strategies {s!r}: budget", spec.budget_items(),
                                   "no budget on a pooled strategy: its N sets its cost, and the curves read "
                                   "every smaller N from its pool (a budget belongs to the searches and adaptive "
                                   "strategies)")
        text = spec.text()
        if text in canonical:
            raise InvalidParameter("strategies", s, "each spec once")
        canonical.append(text)
    if setup.max_tokens is not None and setup.max_tokens < 1:
        raise InvalidParameter("max_tokens", setup.max_tokens, ">= 1")
    if setup.temperature is not None and not setup.temperature >= 0:
        raise InvalidParameter("temperature", setup.temperature, ">= 0")
    task = make_task(setup.task, limit=setup.limit, seed=setup.seed)
    problems = tuple(task.problems())
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise InvalidParameter("task", setup.task, "problems with distinct ids")
    return Sweep(setup, tuple(canonical), problems, task.config(), out)


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = []
    for key in ("task", "setup", "problems"):
        if old.get(key) != new.get(key):
            a, b = old.get(key), new.get(key)
            if isinstance(a, Mapping) and isinstance(b, Mapping):
                out += [f"{key}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)]
            else:
                out.append(f"{key} differ")
    return out


def refuse_foreign(out: str, *, force: bool = False) -> None:
    """A folder `metaloom eval` did not write (files, no config) is refused unless ``force``."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise InvalidParameter("out", out, "a directory (this is a file)")
    if (os.path.isdir(out) and set(os.listdir(out)) - {LOCK} and not force
            and not os.path.exists(os.path.join(out, CONFIG))):
        raise InvalidParameter("out", out, f"an empty or new directory, or one `metaloom eval` wrote (no {CONFIG} "
                               "here); --force uses it anyway")


def prepare_out(sweep: Sweep, *, force: bool = False) -> dict[tuple[str, str], Record]:
    """Create or reopen ``sweep.out``: the records already there, by key. A directory from a
    different task, model or sampling setup is refused (``force``: start it afresh); new
    strategies may be added to a sweep (its config lists the union)."""
    out = sweep.out
    config_path, records_path = os.path.join(out, CONFIG), os.path.join(out, RECORDS)
    if os.path.exists(out) and not os.path.isdir(out):
        raise InvalidParameter("out", out, "a directory (this is a file)")
    config = sweep.config()
    if os.path.exists(config_path) and not force:
        try:
            with open(config_path) as f:
                old = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidParameter("out", out, f"a metaloom eval directory (its {CONFIG} is unreadable: {exc}); "
                                   "--force starts it afresh") from exc
        diff = _differences(old, config)
        if diff:
            raise InvalidParameter("out", out, "a directory of the same configuration, or --force to start it afresh "
                                   f"(it differs: {'; '.join(diff[:5])})")
        config["strategies"] = list(dict.fromkeys([*old.get("strategies", []), *config["strategies"]]))
    else:
        refuse_foreign(out, force=force)
    if force:
        for name in (RECORDS, CONFIG):
            if os.path.exists(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        shutil.rmtree(os.path.join(out, TRACES), ignore_errors=True)
        shutil.rmtree(os.path.join(out, POOLS), ignore_errors=True)
    os.makedirs(os.path.join(out, TRACES), exist_ok=True)
    _write_atomic(config_path, json.dumps(config, indent=1))
    done: dict[tuple[str, str], Record] = {}
    if os.path.exists(records_path):
        _drop_cut_line(records_path)
        for r in read_records(records_path):
            done[r.key] = r
    return done


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _drop_cut_line(path: str) -> None:
    """Truncate a last line a crash cut short (no newline), so appends start on a fresh line."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def trace_name(record: Record) -> str:
    digest = hashlib.sha1(f"{record.problem}\0{record.strategy}".encode()).hexdigest()[:16]
    return f"{TRACES}/{digest}.json"


def pool_path(out: str, problem: str) -> str:
    """Where a problem's sample pools are kept (`metaloom.eval.replay`)."""
    return os.path.join(out, POOLS, hashlib.sha1(problem.encode()).hexdigest()[:16] + ".json")


def read_pool(out: str, problem: str) -> str | None:
    path = pool_path(out, problem)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


class Writer:
    """Appends outcomes to ``records.jsonl`` (trace first, then the record line, flushed and
    synced); drops an outcome whose key is already recorded (a retried task that had in fact
    finished), so nothing is duplicated."""

    def __init__(self, out: str, done: Mapping[tuple[str, str], Record]) -> None:
        self.out = out
        self.done = dict(done)
        self.file = open(os.path.join(out, RECORDS), "a")  # noqa: SIM115 - closed by close()

    def write(self, outcome: Outcome) -> Record | None:
        record = outcome.record
        if record.key in self.done:
            return None
        if outcome.pool is not None:  # before the record, like a trace: kept pools serve later invocations
            from metaloom.eval.replay import dump, load

            kept = read_pool(self.out, record.problem)
            merged = {**(load(kept) if kept else {}), **load(outcome.pool)}
            os.makedirs(os.path.join(self.out, POOLS), exist_ok=True)
            _write_atomic(pool_path(self.out, record.problem), dump(merged))
        if outcome.trace is not None:
            record = dataclasses.replace(record, trace=trace_name(record))
            _write_atomic(os.path.join(self.out, record.trace or ""), json.dumps(list(outcome.trace)))
        self.file.write(json.dumps(record.to_dict()) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.done[record.key] = record
        return record

    def close(self) -> None:
        self.file.close()


def pending(sweep: Sweep, done: Mapping[tuple[str, str], Record]) -> list[Job]:
    """The jobs not yet recorded, problem by problem; a pooled job carries its problem's kept
    sample pools."""
    from metaloom.wiring.spec import parse_spec

    pools: dict[str, str | None] = {}

    def pool(problem: str, spec: str) -> str | None:
        if parse_spec(spec).name not in POOLED:
            return None
        if problem not in pools:
            pools[problem] = read_pool(sweep.out, problem)
        return pools[problem]

    return [Job(i, s, pool(p.id, s)) for i, p in enumerate(sweep.problems) for s in sweep.specs
            if (p.id, s) not in done]


Executor = Callable[[Setup, Sequence[Job], Callable[[Outcome], None]], None]


def local_executor(setup: Setup, jobs: Sequence[Job], emit: Callable[[Outcome], None]) -> None:
    for job in jobs:
        emit(execute(setup, job))


def run_sweep(sweep: Sweep, *, executor: Executor = local_executor, force: bool = False,
              progress: Callable[[Iterable[Record], int], Any] | None = None) -> list[Record]:
    """Run what ``sweep.out`` does not hold yet; returns every record of the sweep's specs. The
    folder is locked for the run (`metaloom.eval.lock`): a second run into it is refused."""
    refuse_foreign(sweep.out, force=force)  # before the lock file is made in a folder that is not ours
    with sweep_lock(sweep.out, sweep.specs):
        return _run_sweep(sweep, executor=executor, force=force, progress=progress)


def _run_sweep(sweep: Sweep, *, executor: Executor, force: bool,
               progress: Callable[[Iterable[Record], int], Any] | None) -> list[Record]:
    done = prepare_out(sweep, force=force)
    jobs = pending(sweep, done)
    writer = Writer(sweep.out, done)
    bar = progress([r for r in done.values() if r.strategy in sweep.specs], len(sweep.problems) * len(sweep.specs)) \
        if progress else None
    try:
        def emit(outcome: Outcome) -> None:
            record = writer.write(outcome)
            if record is not None and bar is not None:
                bar.add(record)

        if jobs:
            executor(sweep.setup, jobs, emit)
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    return [r for r in writer.done.values() if r.strategy in sweep.specs]
