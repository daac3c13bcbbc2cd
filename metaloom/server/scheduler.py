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
unbounded backlog. Waiting means what cannot be admitted: a request whose rows fit the rows left
free (by the running batch and by the requests queued before it) joins at the next step boundary
and does not count (`admissible`), so 64 clients on 64 free rows are never refused for arriving
during one step. Retry-After is derived from the queue (`retry_after`).

Work that cannot join a shared loop (beam search, `Generator.score`) runs as a whole on the loop
thread between steps (`Scheduler.call`), so the model is only ever driven from one thread.

Shutting down is bounded (`begin_drain`): the loop finishes what it holds for up to a timeout,
then ends the rest at a step boundary, each ticket with `Failed(ShuttingDown)` (a 503 in OpenAI's
shape; a stream's error event and ``[DONE]``), and reports itself `drained`. A beam search,
which runs as a whole on the loop thread, is stopped at its next forward past the deadline (its
ledger's `stop`), and so is one whose client went away.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from metaloom.decode.batch import DecodeBatch, Row
from metaloom.decode.specs import BeamParams
from metaloom.errors import BudgetExceeded, Interrupted, InvalidParameter, MetaloomError
from metaloom.generator.local import LocalGenerator, chunks, completion
from metaloom.generator.plan import plan
from metaloom.generator.types import Completion, Request, StreamChunk
from metaloom.ledger import Ledger
from metaloom.server.memory import trim

log = logging.getLogger("metaloom.server")


class ShuttingDown(MetaloomError):
    """The server is shutting down: it admits nothing new, and what ran past the drain's
    deadline was ended (HTTP 503)."""


def _ended() -> ShuttingDown:
    return ShuttingDown("server shutting down: the request was ended before it finished "
                        "(shutdown timeout or a second signal)")


class Overloaded(MetaloomError):
    """The scheduler's queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: int = 1) -> None:
        super().__init__(f"server overloaded: {waiting} requests waiting for a free decode row (limit {limit}); "
                         f"retry after {retry_after} s")
        self.waiting, self.limit, self.retry_after = waiting, limit, retry_after


def admissible(needs: Sequence[int], free: int, busy: bool) -> int:
    """How many of the queued requests (their row counts ``needs``, first in first out) the loop
    admits at its next step boundary, with ``free`` rows free; ``busy``: rows are running. A
    request waits when its rows do not fit what is left, and so does everything behind it (no
    overtaking); one wider than every free row still goes in alone when nothing else runs."""
    taken = 0
    for need in needs:
        if need > free and (taken or busy):
            break
        taken += 1
        free -= need
    return taken


def retry_after(ahead_rows: int, rows_per_second: float | None, max_rows: int, cap: int = 600) -> int:
    """Seconds a refused client should wait: the time for ``ahead_rows`` rows (those queued
    before it, plus its own, less the rows free now) to leave the loop at the observed drain rate,
    ``ceil(ahead_rows / rows_per_second)``; with no rate observed yet, one second per
    ``max_rows`` rows ahead. An integer in ``1 .. cap`` (HTTP Retry-After)."""
    if ahead_rows <= 0:
        return 1
    seconds = ahead_rows / rows_per_second if rows_per_second else ahead_rows / max_rows
    return max(1, min(cap, math.ceil(seconds)))


class DrainRate:
    """Rows finished per second over the last ``window_s`` seconds: rows finished in the window
    divided by the time from the oldest of them to ``now`` (at least one second). Not
    thread-safe: the scheduler holds its lock around it."""

    def __init__(self, window_s: float = 30.0) -> None:
        if not window_s > 0:
            raise InvalidParameter("window_s", window_s, "> 0")
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def record(self, now: float, rows: int) -> None:
        self._events.append((now, rows))
        self._prune(now)

    def rate(self, now: float) -> float | None:
        """Rows per second, or None when no row finished in the window."""
        self._prune(now)
        if not self._events:
            return None
        return sum(r for _, r in self._events) / max(1.0, now - self._events[0][0])

    def _prune(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()


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
    """What the loop is doing now (for /metrics and /health). ``waiting``: requests that cannot be
    admitted at the next step boundary (no room), and calls queued for the loop thread;
    ``queued``: every request not yet in the loop, those about to join included."""

    waiting: int
    running_requests: int
    running_rows: int
    steps: int
    queued: int = 0


class Scheduler:
    """``max_rows``: rows decoded together at most (admission waits for room); ``max_waiting``:
    requests that cannot be admitted (no free row for them) before `submit` refuses with
    `Overloaded`. ``clock``: seconds, for the drain rate behind Retry-After."""

    def __init__(self, generator: LocalGenerator, *, max_rows: int = 64, max_waiting: int = 256,
                 on_step: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
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
        self._busy_rows = 0  # rows in the loop or being admitted to it (under the lock)
        self.clock = clock
        self.drain = DrainRate()  # rows finished per second (under the lock)
        self._deadline: float | None = None  # set by begin_drain: when what still runs is ended
        self._expired = False  # the deadline passed: nothing more is accepted, even from running work
        self.drained = threading.Event()  # draining, and nothing left in or before the loop
        self._worked = False  # since the loop was last idle (idle after work: give freed memory back)
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
                self._check_room(0)
                self.call(lambda: self._beam(ticket, request))
            return ticket
        ticket = Ticket([], p.kind, ledger, sink)
        ticket.rows_to_admit = p.rows(ledger, self.generator.model.device, ticket)
        with self._wake:
            self._check_room(len(ticket.rows_to_admit))
            self._waiting.append(ticket)
            self._wake.notify()
        return ticket

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the loop thread between two steps (the model is driven from one thread)."""
        future: Future[Any] = Future()
        with self._wake:
            self._check_open()
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def stats(self) -> Stats:
        with self._wake:
            blocked = len(self._waiting) - self._admissible()
            return Stats(blocked + len(self._calls), len(self._running),
                         sum(len(b.rows) for b in self._batches.values()), self.steps,
                         len(self._waiting) + len(self._calls))

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin_drain(self, timeout_s: float) -> None:
        """Start a bounded drain: work already submitted runs on for up to ``timeout_s`` seconds
        (work that running requests submit too, e.g. a strategy's next samples), then whatever is
        left is ended with `ShuttingDown` at the next step boundary. ``timeout_s`` 0 ends it now.
        A second call can only bring the deadline closer. `drained` is set once nothing is left.
        Safe from any thread (not from a signal handler: it takes the lock)."""
        if not timeout_s >= 0:
            raise InvalidParameter("timeout_s", timeout_s, ">= 0 seconds")
        with self._wake:
            deadline = self.clock() + timeout_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._wake.notify()

    def close(self) -> None:
        """Stop the loop; what is still running or waiting is cancelled."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _admissible(self, extra: Sequence[int] = ()) -> int:  # under the lock
        """`admissible` over the queue (and ``extra`` requests after it), at the rows free now."""
        return admissible([*(len(t.rows_to_admit) for t in self._waiting), *extra], self.max_rows - self._busy_rows,
                          self._busy_rows > 0)

    def _check_open(self) -> None:  # under the lock
        if self._stop or self._expired:
            raise ShuttingDown("server shutting down: not accepting new work")

    def _check_room(self, need: int) -> None:  # under the lock
        """Refuse a request of ``need`` rows only when it could not be admitted either (it would
        wait) and ``max_waiting`` requests already wait. A call (``need`` 0: beam search, which
        holds the loop thread for its whole run) counts as waiting, as do queued calls."""
        self._check_open()
        queued = len(self._waiting)
        waiting = queued - self._admissible() + len(self._calls)
        fits = need > 0 and self._admissible([need]) > queued
        if fits or waiting < self.max_waiting:
            return
        ahead = sum(len(t.rows_to_admit) for t in self._waiting) + max(need, 1) - (self.max_rows - self._busy_rows)
        raise Overloaded(waiting, self.max_waiting, retry_after(ahead, self.drain.rate(self.clock()), self.max_rows))

    # --- the loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._calls and not self._running:
                    if self._deadline is not None:
                        self.drained.set()
                    if self._worked:
                        self._worked = False
                        trim()
                    self._wake.wait()
                self._worked = True
                if self._stop:
                    break
                expire = self._deadline is not None and self.clock() >= self._deadline
                if expire:
                    self._expired = True
            if expire:
                self._expire()
                continue
            with self._wake:
                calls = list(self._calls)
                self._calls.clear()
                admit = self._take_admissible()
                self._busy_rows += sum(len(t.rows_to_admit) for t in admit)
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
            with self._wake:
                self._busy_rows = sum(len(b.rows) for b in self._batches.values())
        self._shutdown()

    def _take_admissible(self) -> list[Ticket]:  # under the lock
        running = sum(len(b.rows) for b in self._batches.values())
        n = admissible([len(t.rows_to_admit) for t in self._waiting], self.max_rows - running, running > 0)
        return [self._waiting.popleft() for _ in range(n)]

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
        with self._wake:
            self.drain.record(self.clock(), len(ticket.rows))
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
        # beam search owns its loop: its ledger stops it at the next forward once the drain's
        # deadline passed or the client went away (what it did until then is charged)
        run = Ledger(parent=ticket.ledger, stop=lambda: ticket.cancelled or self._past_deadline())
        try:
            found = self.generator.generate([request], ledger=run)[0]
        except Interrupted:
            if ticket.cancelled:
                ticket.done = True
                ticket.sink(Finished(()))
            else:
                self._fail(ticket, _ended())
            return
        except Exception as exc:
            self._fail(ticket, exc)
            return
        ticket.first_token_at = time.perf_counter()
        for i, c in enumerate(found):
            ticket.sink(StreamChunk(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, i, c.error,
                                    c.top_logprobs or ()))
        ticket.done = True
        ticket.sink(Finished(tuple(found)))

    def _past_deadline(self) -> bool:
        """Whether a drain's deadline has passed (read without the lock: one float)."""
        deadline = self._deadline
        return deadline is not None and self.clock() >= deadline

    def _expire(self) -> None:
        """The drain's deadline passed: end everything queued and running, each with its error."""
        error = _ended()
        with self._wake:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
        for ticket in waiting:
            self._fail(ticket, error)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        running = [t for t in self._running if not t.done]
        for ticket in running:
            live = [r for r in ticket.rows if not r.state.done]
            batch = self._batches.get(ticket.kind)
            if live and batch is not None:
                with contextlib.suppress(Exception):
                    batch.cancel(live)
            self._fail(ticket, error)
        self._running = []
        with self._wake:
            self._busy_rows = sum(len(b.rows) for b in self._batches.values())
        log.warning("shutdown timeout: ended %d running and %d queued requests", len(running), len(waiting))

    def _shutdown(self) -> None:
        with self._wake:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
        for ticket in waiting + self._running:
            if not ticket.done:
                self._fail(ticket, ShuttingDown("server shutting down"))
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(ShuttingDown("server shutting down"))
        for batch in self._batches.values():
            with contextlib.suppress(Exception):
                batch.close()
        self._batches.clear()
