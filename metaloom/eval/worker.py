"""One job of a sweep, run in the process that executes it: `execute(setup, job)` takes plain
data and returns plain data (`Outcome`), so an executor can call it here (`runner.local_executor`)
or in a Ray worker (`metaloom.eval.ray_executor`). Each process builds its engine and task once
(`worker`) and reuses them for every job it is given.

Each run has its own ledger and its own radix prefix cache: it reuses its prompt and paths
across its own calls, as a user's run would, and inherits no other run's prefill, so the
FLOPs of two strategies compare. Samples are seeded per problem (``seed`` and the problem's
position), so a rerun draws the same samples.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import MetaloomError
from metaloom.eval.pool import attribute, candidates_of, model_row_flops, selection_of
from metaloom.eval.records import POOLED, Record
from metaloom.eval.tasks.base import Problem, Task
from metaloom.wiring import engines
from metaloom.wiring.spec import Spec


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
    activations: str = "float"  # --activations q8: the native engine's int8 inputs
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
        for k, default in (("activations", "float"), ("kv_dtype", "auto"), ("shared_prefix_attention", "auto"),
                           ("kv_policy", "full"),
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
                               weights=setup.weights, activations=setup.activations, kv_dtype=setup.kv_dtype,
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
