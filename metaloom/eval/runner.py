"""Run a sweep: every (problem, strategy spec) pair once, each record appended to
``DIR/records.jsonl`` as it finishes (`metaloom.eval.records`).

The driver (`run_sweep`) owns the directory: it checks the configuration against what ``DIR``
already holds, skips the pairs already recorded, writes each trace file before the record
that names it (a crash leaves no record pointing at nothing), and drops a last line a crash
cut short. The work itself is `execute(setup, job)`: plain data in, plain data out, so an
executor can run it here or in a Ray worker (`metaloom.eval.ray_executor`); each process
builds its engine and task once (`worker`).

Each run has its own ledger and its own radix prefix cache: it reuses its prompt and paths
across its own calls, as a user's run would, and inherits no other run's prefill, so the
FLOPs of two strategies compare. Samples are seeded per problem (``seed`` and the problem's
position), so a rerun draws the same samples.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.eval.lock import LOCK, sweep_lock
from metaloom.eval.pool import attribute, candidates_of, model_row_flops, selection_of
from metaloom.eval.records import CONFIG, POOLED, POOLS, RECORDS, TRACES, Record, read_records
from metaloom.eval.tasks.base import Problem, Task
from metaloom.wiring import engines
from metaloom.wiring.spec import Spec, check_spec

EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Setup:
    """Everything a worker needs to build its task and engine (picklable, for Ray).

    ``max_tokens`` / ``temperature``: when set, they replace every strategy's own (temperature
    not for ``greedy``). ``factory``: ``"module:function"`` returning a `Generator` instead of
    loading ``model`` (tests run scripted generators through the same path). ``threads``:
    torch threads per worker (None: torch's default)."""

    task: str
    limit: int | None = None
    seed: int = 0
    model: str = "default"
    dtype: str = "float32"
    device: str = "auto"
    backend: str = "auto"
    weights: str = "auto"
    kv_dtype: str = "auto"
    shared_prefix_attention: str = "auto"
    kv_policy: str = "full"
    kv_budget: int | None = None
    chat_template_args: str | None = None  # a JSON object (hashable, as a Setup must be): --chat-template-arg
    base_url: str | None = None
    api_key: str | None = None
    model_params: float | None = None
    tokenizer: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    prefix_cache_mb: int = 512
    threads: int | None = None
    factory: str | None = None

    def identity(self) -> dict[str, Any]:
        """What makes two sweeps comparable (recorded in config.json): not the key, the
        thread count or where the work runs."""
        d = dataclasses.asdict(self)
        for k in ("api_key", "threads", "prefix_cache_mb"):
            d.pop(k)
        # the engine options at their default are left out: a sweep written before they existed
        # ran with them at their defaults, and stays comparable (resumable) with one run now
        for k, default in (("kv_dtype", "auto"), ("shared_prefix_attention", "auto"), ("kv_policy", "full"),
                           ("kv_budget", None), ("chat_template_args", None)):
            if d[k] == default:
                d.pop(k)
        return d


@dataclass(frozen=True)
class Job:
    """One run: the problem's position in the task and the strategy spec (canonical text);
    ``pool``: for a pooled strategy, the problem's sample pools kept by earlier invocations
    (`metaloom.eval.replay.dump` text), for the worker to replay."""

    problem: int
    spec: str
    pool: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Outcome:
    """What a job returns: its record and, for a tree search, its trace events (the driver
    writes them to ``traces/`` before the record)."""

    record: Record
    trace: tuple[Mapping[str, Any], ...] | None = None
    pool: str | None = None  # the sample pools this run drew (`replay.dump` text), for DIR/pools/


# ----------------------------------------------------------------------------------- worker


class Worker:
    """A process's task, problems and generator, built once and reused for every job."""

    def __init__(self, setup: Setup) -> None:
        from metaloom.eval.tasks import make_task

        self.setup = setup
        if setup.threads is not None:
            import torch

            torch.set_num_threads(setup.threads)
        self.task: Task = make_task(setup.task, limit=setup.limit, seed=setup.seed)
        self.problems: Sequence[Problem] = self.task.problems()
        self.draws: dict[str, Any] = {}  # the current problem's sample pools (`metaloom.eval.replay`)
        self.draws_of: int | None = None
        self.draws_read: str | None = None  # the kept pools already merged into draws
        self.loaded: Any = None
        self.generator: Any = None
        self.row_flops: Any = None
        self.second: dict[str, Any] = {}  # second models a strategy names (a drafter), loaded once
        if setup.factory is not None:
            module, _, name = setup.factory.partition(":")
            self.generator = getattr(importlib.import_module(module), name)()
            model = getattr(self.generator, "model", None)
            self.row_flops = model_row_flops(model) if hasattr(model, "flops") else None
        elif setup.backend == "openai":
            self.generator = engines.remote_generator(setup.base_url, setup.model, api_key=setup.api_key,
                                                      tokenizer=setup.tokenizer, model_params=setup.model_params)
        else:
            from metaloom.models.load import load

            self.loaded = load(setup.model, dtype=setup.dtype, device=setup.device, backend=setup.backend,
                               weights=setup.weights, kv_dtype=setup.kv_dtype,
                               shared_prefix_attention=setup.shared_prefix_attention,
                               kv_policy=setup.kv_policy, kv_budget=setup.kv_budget,
                               **({"chat_template_args": json.loads(setup.chat_template_args)}
                                  if setup.chat_template_args is not None else {}))
            self.row_flops = model_row_flops(self.loaded.model)

    def generator_for_run(self, problem: int, pooled: bool, saved: str | None = None) -> Any:
        """The local engine with a fresh prefix cache (see the module docstring), else the
        generator; for a ``pooled`` strategy's run, replaying the problem's sample pools drawn
        by earlier runs. Only pooled runs share draws: their one sampling call is all they ask,
        while a tree search or an adaptive vote goes on from its first call, at a cost that
        depends on what that call left in its own prefix cache, which a replay never fills
        (two searches with the same first expansion would otherwise charge the second a
        re-prefill of every path). ``saved``: the problem's pools from ``DIR/pools/``."""
        from metaloom.eval.replay import ReplayGenerator, load

        if self.draws_of != problem:
            self.draws, self.draws_of, self.draws_read = {}, problem, None
        if saved and saved != self.draws_read:  # every pooled job of a problem carries the same pools: read once
            for key, draw in load(saved).items():
                self.draws.setdefault(key, draw)
            self.draws_read = saved
        if self.loaded is None:
            generator = self.generator
        else:
            from metaloom.generator.local import LocalGenerator

            generator = LocalGenerator(self.loaded,
                                       prefix_cache=engines.prefix_cache(self.setup.prefix_cache_mb, self.loaded))
        return ReplayGenerator(generator, self.draws) if pooled else generator

    def second_generator(self, model: str) -> Any:
        """Another model a strategy names (spec_reason's drafter), loaded once per worker as the
        sweep's model is (on the same server with --backend openai)."""
        if model not in self.second:
            s = self.setup
            if s.backend == "openai":
                self.second[model] = engines.remote_generator(s.base_url, model, api_key=s.api_key, tokenizer=s.tokenizer)
            else:
                from metaloom.generator.local import LocalGenerator
                from metaloom.models.load import load

                other = load(model, dtype=s.dtype, device=s.device, backend=s.backend, weights=s.weights,
                             kv_dtype=s.kv_dtype)
                self.second[model] = LocalGenerator(other, prefix_cache=engines.prefix_cache(s.prefix_cache_mb, other))
        return self.second[model]

    def strategy(self, spec: Spec, generator: Any, problem: int) -> Any:
        """The spec's strategy with the task's extractor (where it needs one and the spec named
        none) and the sweep's sampling settings, seeded for this problem."""
        # public_tests feedback and scorers run the tests this problem shows, not its graders'
        strategy = spec.build({"generator": generator, "load_generator": self.second_generator,
                               "public_tests": self.task.public_tests(self.problems[problem])})
        # votes need the task's answers; a strategy whose extractor is optional (best-of-N, MBR:
        # None compares whole texts) keeps its own unless the spec names one
        extractor = next((f for f in dataclasses.fields(strategy) if f.name == "extractor"), None)
        if extractor is not None and extractor.default is not None and "extractor" not in spec.params:
            strategy = dataclasses.replace(strategy, extractor=self.task.extractor())
        from metaloom.sampling.params import SamplingParams

        params = getattr(strategy, "params", None)
        if isinstance(params, SamplingParams):
            changes: dict[str, Any] = {"seed": self.setup.seed * 1_000_003 + problem}
            if self.setup.max_tokens is not None:
                changes["max_tokens"] = self.setup.max_tokens
            if self.setup.temperature is not None and spec.name != "greedy":
                changes["temperature"] = self.setup.temperature
            strategy = dataclasses.replace(strategy, params=dataclasses.replace(params, **changes))
        return strategy

    def run(self, job: Job) -> Outcome:
        from metaloom.ledger import Ledger
        from metaloom.wiring.spec import parse_spec

        problem = self.problems[job.problem]
        spec = parse_spec(job.spec)
        generator = self.generator_for_run(job.problem, pooled=spec.name in POOLED, saved=job.pool)
        drawn_before = set(self.draws)
        ledger = Ledger(budget=spec.budget())  # budget.FIELD=LIMIT in the spec: the run stops there, cleanly
        start = time.perf_counter()
        try:
            strategy = self.strategy(spec, generator, job.problem)
            result = strategy.run(problem.prompt, generator, ledger=ledger)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # the sweep goes on; the record says what failed and what it cost
            seconds = time.perf_counter() - start
            error = f"{type(exc).__name__}: {exc}" if isinstance(exc, MetaloomError) else traceback.format_exc(limit=3)
            return Outcome(Record(problem.id, job.spec, None, False, 0.0, "", ledger.usage.to_dict(), round(seconds, 4),
                                  error=error))
        seconds = time.perf_counter() - start
        grade = self.task.grade(problem, result.best)
        trace = tuple(e.to_dict() for e in result.trace)
        tree = trace if any(e.get("kind") == "tree" for e in trace) else None
        record = Record(problem.id, job.spec, grade.answer, grade.correct, grade.score, result.best,
                        result.usage.to_dict(), round(seconds, 4), result.stopped_reason)
        if spec.name in POOLED and result.candidates:
            grades = [self.task.grade(problem, c.text) for c in result.candidates]
            costs, shared = attribute(result, self.row_flops)
            extractor = getattr(strategy, "extractor", None)
            selection = selection_of(spec.name, result, extractor, getattr(strategy, "transform", None))
            record = dataclasses.replace(record, candidates=candidates_of(result, grades, costs), shared=shared,
                                         selection=selection)
        from metaloom.eval.replay import dump

        drawn = {k: v for k, v in self.draws.items() if k not in drawn_before}
        return Outcome(record, tree, dump(drawn) if drawn else None)


_WORKERS: dict[Setup, Worker] = {}


def worker(setup: Setup) -> Worker:
    """This process's `Worker` for ``setup`` (built on first use)."""
    if setup not in _WORKERS:
        _WORKERS.clear()  # one engine per process
        _WORKERS[setup] = Worker(setup)
    return _WORKERS[setup]


def execute(setup: Setup, job: Job) -> Outcome:
    """Run one job in this process (what an executor calls)."""
    return worker(setup).run(job)


# ----------------------------------------------------------------------------------- driver


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
