"""Continuous batching: one thread owns the engine's decode loops; requests join and leave them
between steps.

Every HTTP handler (and every strategy running for one) hands its `Request` to `Scheduler.submit`,
which validates and prepares it in the caller's thread (a bad request raises there, before any
compute) and queues it. The loop thread, between two steps, admits what is queued into the
running `DecodeBatch` of its decoder (prompts prefilled, through the shared radix prefix cache),
steps every batch that has rows, and hands each ticket its new chunks. Finished rows leave at
once and free their KV; a cancelled ticket (a client that went away) has its rows cancelled at
the next step boundary.

The queue is bounded: `Overloaded` (HTTP 429 with Retry-After) when it is full, never an
unbounded backlog. Work that cannot join a shared loop (beam search, `Generator.score`) runs as a
whole on the loop thread between steps (`Scheduler.call`), so the model is only ever driven
from one thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from metaloom.decode.batch import DecodeBatch, Row
from metaloom.errors import BudgetExceeded, InvalidParameter, MetaloomError
from metaloom.generator.local import LocalGenerator, chunks, completion
from metaloom.generator.plan import plan
from metaloom.generator.specs import BeamParams
from metaloom.generator.types import Completion, Request, StreamChunk
from metaloom.ledger import Ledger

log = logging.getLogger("metaloom.server")


class Overloaded(MetaloomError):
    """The scheduler's queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: int = 1) -> None:
        super().__init__(f"server overloaded: {waiting} requests waiting (limit {limit}); retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(frozen=True)
class Finished:
    """A ticket's last event: every sample's completion, in sample order."""

    completions: tuple[Completion, ...]


@dataclass(frozen=True)
class Failed:
    """A ticket's last event when the engine failed under it (a bug, logged with its traceback)."""

    error: BaseException


Event = StreamChunk | Finished | Failed
Sink = Callable[[Event], None]


@dataclass(eq=False)
class Ticket:
    """One submitted request: its rows once admitted, and where its events go. ``sink`` is
    called on the loop thread, so it must only hand the event over (a queue put)."""

    rows_to_admit: list[Any]
    kind: type
    ledger: Ledger
    sink: Sink
    submitted: float = field(default_factory=time.perf_counter)
    rows: list[Row] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    first_token_at: float | None = None

    def cancel(self) -> None:
        """Ask the loop to end this request's rows at the next step boundary (thread-safe)."""
        self.cancelled = True


@dataclass(frozen=True)
class Stats:
    """What the loop is doing now (for /metrics and /health)."""

    waiting: int
    running_requests: int
    running_rows: int
    steps: int


class Scheduler:
    """``max_rows``: rows decoded together at most (admission waits for room); ``max_waiting``:
    requests queued beyond that before `submit` refuses with `Overloaded`."""

    def __init__(self, generator: LocalGenerator, *, max_rows: int = 64, max_waiting: int = 256,
                 on_step: Callable[[int], None] | None = None) -> None:
        if max_rows < 1:
            raise InvalidParameter("max_rows", max_rows, ">= 1")
        if max_waiting < 0:
            raise InvalidParameter("max_waiting", max_waiting, ">= 0")
        self.generator = generator
        self.max_rows, self.max_waiting = max_rows, max_waiting
        self.on_step = on_step  # called with the batch size after each step (metrics)
        self._waiting: deque[Ticket] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running: list[Ticket] = []
        self._batches: dict[type, DecodeBatch] = {}
        self._wake = threading.Condition()
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="metaloom-scheduler", daemon=True)
        self._thread.start()

    # --- the callers' side (any thread) --------------------------------------------------------
    def submit(self, request: Request, ledger: Ledger, sink: Sink) -> Ticket:
        """Validate and queue ``request``; its chunks, then `Finished` (or `Failed`), go to ``sink``."""
        p = plan(self.generator, request)  # a bad request raises here, in the caller's thread
        if p.kind is BeamParams:  # beam search reorders its rows every step: it runs as a whole
            ticket = Ticket([], BeamParams, ledger, sink)
            with self._wake:
                self._check_room()
                self.call(lambda: self._beam(ticket, request))
            return ticket
        ticket = Ticket([], p.kind, ledger, sink)
        ticket.rows_to_admit = p.rows(ledger, self.generator.model.device, ticket)
        with self._wake:
            self._check_room()
            self._waiting.append(ticket)
            self._wake.notify()
        return ticket

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the loop thread between two steps (the model is driven from one thread)."""
        future: Future[Any] = Future()
        with self._wake:
            if self._stop:
                raise RuntimeError("scheduler stopped")
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def stats(self) -> Stats:
        with self._wake:
            return Stats(len(self._waiting), len(self._running), sum(len(b.rows) for b in self._batches.values()),
                         self.steps)

    def close(self) -> None:
        """Stop the loop; what is still running or waiting is cancelled."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _check_room(self) -> None:  # under the lock
        waiting = len(self._waiting) + len(self._calls)
        if waiting >= self.max_waiting:
            raise Overloaded(waiting, self.max_waiting)

    # --- the loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._calls and not self._running:
                    self._wake.wait()
                if self._stop:
                    break
                calls = list(self._calls)
                self._calls.clear()
                admit = self._take_admissible()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller, who decides
                        future.set_exception(exc)
            for ticket in admit:
                self._admit(ticket)
            if admit:  # their first tokens go out now, not after the next step (time to first token)
                self._deliver()
            self._cancel_requested()
            for kind, batch in list(self._batches.items()):
                if batch.rows:
                    self._step(kind, batch)
            self._deliver()
        self._shutdown()

    def _take_admissible(self) -> list[Ticket]:
        room = self.max_rows - sum(len(b.rows) for b in self._batches.values())
        out: list[Ticket] = []
        while self._waiting:
            ticket = self._waiting[0]
            need = len(ticket.rows_to_admit)
            # wait for room, unless nothing else runs: a request wider than max_rows still goes in alone
            if need > room and (out or any(b.rows for b in self._batches.values())):
                break
            out.append(self._waiting.popleft())
            room -= need
        return out

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            self._finish(ticket)
            return
        batch = self._batches.get(ticket.kind)
        if batch is None:
            batch = self._batches[ticket.kind] = self.generator.new_batch(ticket.kind)
        try:
            ticket.rows = batch.admit(ticket.rows_to_admit)
        except Exception as exc:
            self._fail(ticket, exc)
            return
        ticket.rows_to_admit = []
        self._running.append(ticket)

    def _cancel_requested(self) -> None:
        for ticket in self._running:
            if ticket.cancelled and not ticket.done:
                live = [r for r in ticket.rows if not r.state.done]
                batch = self._batches.get(ticket.kind)
                if live and batch is not None:
                    batch.cancel(live)

    def _step(self, kind: type, batch: DecodeBatch) -> None:
        try:
            batch.step()
        except Exception as exc:
            log.exception("decode step failed; failing %d rows", len(batch.rows))
            victims = [t for t in self._running if t.kind is kind and not t.done]
            with contextlib.suppress(Exception):
                batch.close()
            del self._batches[kind]
            for ticket in victims:
                self._fail(ticket, exc)
            return
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(batch.rows))

    def _deliver(self) -> None:
        still: list[Ticket] = []
        for ticket in self._running:
            if ticket.done:
                continue
            for chunk in chunks(ticket.rows):
                if ticket.first_token_at is None and chunk.token_ids:
                    ticket.first_token_at = time.perf_counter()
                ticket.sink(chunk)
            if all(r.state.done for r in ticket.rows):
                self._finish(ticket)
            else:
                still.append(ticket)
        self._running = still

    def _finish(self, ticket: Ticket) -> None:
        ticket.done = True
        with contextlib.suppress(BudgetExceeded):
            ticket.ledger.charge(seconds=time.perf_counter() - ticket.submitted)
        ticket.sink(Finished(tuple(completion(r.state) for r in ticket.rows)))

    def _fail(self, ticket: Ticket, exc: BaseException) -> None:
        ticket.done = True
        ticket.sink(Failed(exc))

    def _beam(self, ticket: Ticket, request: Request) -> None:
        if ticket.cancelled:
            ticket.done = True
            ticket.sink(Finished(()))
            return
        try:
            found = self.generator.generate([request], ledger=ticket.ledger)[0]
        except Exception as exc:
            self._fail(ticket, exc)
            return
        ticket.first_token_at = time.perf_counter()
        for i, c in enumerate(found):
            ticket.sink(StreamChunk(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, i, c.error,
                                    c.top_logprobs or ()))
        ticket.done = True
        ticket.sink(Finished(tuple(found)))

    def _shutdown(self) -> None:
        with self._wake:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
        for ticket in waiting + self._running:
            if not ticket.done:
                self._fail(ticket, RuntimeError("server shutting down"))
        for _, future in calls:
            future.cancel()
        for batch in self._batches.values():
            with contextlib.suppress(Exception):
                batch.close()
        self._batches.clear()
