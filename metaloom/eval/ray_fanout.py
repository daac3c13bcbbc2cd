"""The driver's side of a Ray sweep (`metaloom.eval.ray_executor`): a pool of Ray actors, one
per worker, each a process that builds its task and engine once (`worker.worker`, when the
actor starts) and then runs job after job (`worker.execute`). Results come back as they finish
(``ray.wait``) and each is handed to ``emit`` in the driver, so the driver alone writes
``records.jsonl``.

Why actors, not tasks: a worker's engine (a loaded model, its threads) is the expensive
part, so a worker is a long-lived process with one job in flight; the driver feeds an actor
its next job when the last one comes back, so a slow job holds up no one else.

Why a worker keeps to one problem (`next_job`): the strategies of one problem share its sample
pools (`metaloom.eval.replay`: majority vote, best-of-N and MBR at the same N replay one draw),
and a worker holds only the pools of the problem it ran last. So a problem's jobs all run on
one worker, one after another: a free worker takes the next job of its own problem, else the
first job of a problem no other worker is on, else it waits (the queue's problems are all
taken). Without this, two workers would split a problem's strategies between them and draw
its pool twice. The price: parallelism is across problems, so a sweep of fewer problems than
workers leaves some idle.

Faults:

- a worker process that dies (killed, out of memory, its node lost) loses only the job it
  held: the driver starts a fresh actor in its place and puts the job back at the front of
  the queue, for whichever worker is free first. A job that kills its worker more than
  ``max_retries`` times is `WorkerLost` (it would kill every worker). A result is emitted
  only once it is in the driver, and the `Writer` drops a key it already holds, so nothing
  is duplicated;
- an exception out of `execute` is not a death: `execute` turns a strategy's failure into a
  record, so what escapes it is a worker that cannot be built (a bad model path, a missing
  task file) or a bug. It is raised in the driver as it was raised in the worker (a
  `MetaloomError` keeps its type; anything else is `WorkerFailed`), not retried.

Importing this module does not import Ray (`_actor_class`).
"""

from __future__ import annotations

import os
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import MetaloomError
from metaloom.eval.worker import Job, Outcome, Setup, execute, worker


class WorkerFailed(MetaloomError):
    """A Ray worker raised something other than a `MetaloomError` (it could not be built, or a
    bug): ``remote_traceback`` is the worker's own traceback."""

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        self.remote_traceback = remote_traceback
        super().__init__(message + (f"\n--- in the worker:\n{remote_traceback}" if remote_traceback else ""))


class WorkerLost(WorkerFailed):
    """A job's worker process died more than ``max_retries`` times (the job, or the machine,
    kills every worker that runs it)."""




@dataclass(frozen=True)
class _Failure:
    """An exception out of a worker, carried as data: Ray cannot rebuild exceptions whose
    ``__init__`` takes other arguments than their message (most `MetaloomError`s), so the
    class, message and attributes travel and the driver rebuilds it."""

    kind: type[MetaloomError] | None  # None: not a MetaloomError (its class may not exist in the driver)
    name: str
    message: str
    state: dict[str, Any]
    remote_traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> _Failure:
        import pickle

        state: dict[str, Any] = {}
        for key, value in vars(exc).items():
            try:
                pickle.dumps(value)
            except Exception:  # an attribute that cannot travel is left behind, not the error
                continue
            state[key] = value
        kind = type(exc) if isinstance(exc, MetaloomError) else None
        return cls(kind, type(exc).__name__, str(exc), state if kind else {}, traceback.format_exc())

    def error(self) -> Exception:
        """The worker's error, as the driver raises it."""
        if self.kind is None:
            return WorkerFailed(f"a worker failed: {self.name}: {self.message}", self.remote_traceback)
        exc = self.kind.__new__(self.kind)
        Exception.__init__(exc, self.message)
        exc.__dict__.update(self.state)
        return exc


class EvalActor:
    """One worker process (made a Ray actor by `_actor_class`)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def ready(self) -> _Failure | int:
        """Build the task and engine now (so every worker loads at once, and a setup that
        cannot load fails before any job); this process's id, or the failure."""
        try:
            worker(self.setup)
        except Exception as exc:
            return _Failure.of(exc)
        return os.getpid()

    def run(self, job: Job) -> _Failure | Outcome:
        try:
            return execute(self.setup, job)
        except Exception as exc:
            return _Failure.of(exc)


_ACTOR: Any = None


def _actor_class() -> Any:
    """`EvalActor` as a Ray actor class (made on first use: importing this module does not
    import Ray)."""
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(EvalActor)
    return _ACTOR


class Fanout:
    """The driver's loop: ``workers`` actors, one job in flight on each, a queue of the rest.
    ``waiting`` maps each pending Ray reference to its worker slot and job (None: the
    worker's ``ready`` call)."""

    def __init__(self, setup: Setup, workers: int, num_cpus_per_worker: float, max_retries: int) -> None:
        self.setup = setup
        self.options = {"num_cpus": num_cpus_per_worker, "max_restarts": 0, "max_task_retries": 0}
        self.max_retries = max_retries
        self.actors: list[Any] = [None] * workers
        self.waiting: dict[Any, tuple[int, Job | None]] = {}
        self.queue: deque[Job] = deque()
        self.deaths: dict[Job, int] = {}
        self.started: list[int] = [0] * workers  # consecutive deaths of a slot before its worker was ready
        self.idle: list[int] = []  # ready slots with nothing to do
        self.on: list[int | None] = [None] * workers  # the problem each slot's worker holds the pools of

    def run(self, jobs: Sequence[Job], emit: Callable[[Outcome], None]) -> None:
        import ray

        self.queue.extend(jobs)
        try:
            for slot in range(min(len(self.actors), len(jobs))):
                self._start(slot)
            while self.waiting:
                [ref], _ = ray.wait(list(self.waiting), num_returns=1)
                slot, job = self.waiting.pop(ref)
                self._finished(slot, job, ref, emit)
        finally:
            for actor in self.actors:
                if actor is not None:
                    ray.kill(actor, no_restart=True)

    def _start(self, slot: int) -> None:
        """A fresh worker in ``slot``; it gets jobs once it is ready."""
        import ray

        if self.actors[slot] is not None:
            ray.kill(self.actors[slot], no_restart=True)
        self.on[slot] = None  # a fresh process holds no pools
        actor = _actor_class().options(**self.options).remote(self.setup)
        self.actors[slot] = actor
        self.waiting[actor.ready.remote()] = (slot, None)

    def _feed(self, slot: int) -> None:
        """The next job to ``slot``'s worker, or the slot idles (nothing queued, or only jobs of
        problems other workers are on)."""
        others = {p for s, p in enumerate(self.on) if s != slot and p is not None}
        i = next_job([j.problem for j in self.queue], self.on[slot], others)
        if i is None:
            self.idle.append(slot)
            return
        job = self.queue[i]
        del self.queue[i]
        self.on[slot] = job.problem
        self.waiting[self.actors[slot].run.remote(job)] = (slot, job)

    def _finished(self, slot: int, job: Job | None, ref: Any, emit: Callable[[Outcome], None]) -> None:
        import ray
        from ray.exceptions import ObjectLostError, RayActorError, RayError, WorkerCrashedError

        try:
            value = ray.get(ref)
        except (RayActorError, WorkerCrashedError, ObjectLostError) as exc:
            self._lost(slot, job, exc)
            return
        except RayError as exc:  # not a death, not the worker's own exception: Ray failed the call
            raise WorkerFailed(f"Ray failed a worker's call: {type(exc).__name__}: {exc}") from exc
        if isinstance(value, _Failure):
            raise value.error()
        if job is None:
            self.started[slot] = 0
        else:
            emit(value)
        self._feed(slot)

    def _lost(self, slot: int, job: Job | None, exc: Exception) -> None:
        """A worker died: its job back at the front of the queue, to an idle worker if there is
        one, and a fresh worker in its slot while jobs are left (`WorkerLost` once a job, or a
        slot's start, has died more than ``max_retries`` times)."""
        if job is None:
            self.started[slot] += 1
            if self.started[slot] > self.max_retries:
                raise WorkerLost(f"a worker died {self.started[slot]} times while starting (its engine could not "
                                 f"be built): {type(exc).__name__}: {exc}")
        else:
            self.on[slot] = None  # its problem's pools died with it: any worker may take the job
            self.deaths[job] = self.deaths.get(job, 0) + 1
            if self.deaths[job] > self.max_retries:
                raise WorkerLost(f"job {job} killed its worker {self.deaths[job]} times (max_retries="
                                 f"{self.max_retries}): {type(exc).__name__}: {exc}")
            self.queue.appendleft(job)
            if self.idle:
                self._feed(self.idle.pop())
        if self.queue:
            self._start(slot)
        else:
            import ray

            ray.kill(self.actors[slot], no_restart=True)
            self.actors[slot] = None


def next_job(problems: Sequence[int], mine: int | None, others: set[int]) -> int | None:
    """The index in a queue of jobs' ``problems`` that a free worker takes, the one whose last
    problem was ``mine`` while other workers are on ``others``; None: it waits (see the module
    docstring)."""
    for i, p in enumerate(problems):
        if p == mine:
            return i
    for i, p in enumerate(problems):
        if p not in others:
            return i
    return None
