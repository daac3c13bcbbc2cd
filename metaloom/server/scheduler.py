"""Continuous batching: one thread owns the engine; requests join and leave its decode loops
between steps.

Every HTTP handler (and every strategy running for one) hands its `Request` to `Scheduler.submit`,
which validates and prepares it in the caller's thread (a bad request raises there, before any
compute: over a server limit, or a KV need the pool can never hold) and queues it. The loop
thread, between two steps, admits what fits (`metaloom.server.admission`: rows and KV memory)
into the running `DecodeBatch` of its decoder (prompts prefilled, through the shared radix prefix
cache), steps every batch that has rows, and hands each ticket its new chunks. Finished rows leave
at once and free their KV; a cancelled ticket (a client that went away) has its rows cancelled at
the next step boundary.

Beam search reorders its rows every step, so it cannot share a batch; it runs as a lane of its
own beside the batches, with a fair share (`metaloom.server.lanes`).

Memory: before a batch steps, the pool must hold its new tokens. When it cannot, the prefix
cache gives back what no row holds, then the youngest requests are preempted (their rows leave
the batch with their state kept, and are recomputed when admitted again, ahead of the queue:
vLLM's recompute preemption), so no admitted request fails for want of memory. When the loop goes
idle the pool gives back what a burst made it grow to (`trim`).

The queue is bounded: `Overloaded` (HTTP 429 with Retry-After) when it is full, never an
unbounded backlog. Waiting means what cannot be admitted at the next step boundary.

Work that needs the model outside the loop (`Generator.score`, prompt log-probabilities) runs on
the loop thread between steps (`Scheduler.call`), so the model is only ever driven from one thread.

Shutting down is bounded (`begin_drain`): the loop finishes what it holds for up to a timeout,
then ends the rest at a step boundary, each ticket with `Failed(ShuttingDown)` (a 503 in OpenAI's
shape; a stream's error event and ``[DONE]``), and reports itself `drained`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from metaloom.decode.batch import DecodeBatch
from metaloom.errors import BudgetExceeded, InvalidParameter
from metaloom.generator.local import LocalGenerator, chunks, completion
from metaloom.generator.types import Completion, Request
from metaloom.ledger import Ledger
from metaloom.server.admission import (
    DrainRate,
    Overloaded,
    admissible,
    free_slots,
    kv_need,
    prefill_tokens,
    retry_after,
    shortfall,
    within_budget,
)
from metaloom.server.ending import end_all
from metaloom.server.intake import streams, ticket_for
from metaloom.server.lanes import BeamLanes
from metaloom.server.limits import MAX_PREFILL_TOKENS, Limits, check_sizes
from metaloom.server.memory import shrink_pool, trim
from metaloom.server.tickets import Event, Failed, Finished, ShuttingDown, Sink, Stats, Ticket, ended

__all__ = ["Event", "Failed", "Finished", "Overloaded", "Scheduler", "ShuttingDown", "Ticket"]

log = logging.getLogger("metaloom.server")


class Scheduler:
    """``max_rows``: rows decoded together at most (admission waits for room); ``max_waiting``:
    requests that cannot be admitted before `submit` refuses with `Overloaded`; ``max_prefill_tokens``:
    prompt tokens admitted between two steps; ``limits``: what one request may ask for (`Limits`).
    ``clock``: seconds, for the drain rate behind Retry-After."""

    def __init__(self, generator: LocalGenerator, *, max_rows: int = 64, max_waiting: int = 256,
                 max_prefill_tokens: int = MAX_PREFILL_TOKENS, on_step: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, limits: Limits | None = None) -> None:
        check_sizes(max_rows, max_waiting, max_prefill_tokens)
        self.generator = generator
        self.max_rows, self.max_waiting, self.max_prefill_tokens = max_rows, max_waiting, max_prefill_tokens
        self.limits = limits or Limits()
        self.on_step = on_step  # called with the batch size after each step (metrics)
        spec = generator.speculative
        self._draft = 0 if spec is None else spec.num_draft + 1  # positions a step may write past the pending token
        self._waiting: deque[Ticket] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running: list[Ticket] = []  # tickets with rows in a batch
        self.lanes = BeamLanes(generator, self._finish, self._fail)  # beam searches beside the batches
        self._batches: dict[type, DecodeBatch] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._busy_rows = 0  # rows in the loop or being admitted to it, beams included (under the lock)
        self._prefilling = 0  # of those, rows being admitted now
        self._order = itertools.count(1)  # admissions, in order (the youngest is preempted first)
        self.preemptions = 0
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
        ticket = ticket_for(self.generator, self.limits, request, ledger, sink, draft=self._draft,
                            search=self.lanes.search)
        with self._wake:
            self._check_room(ticket)
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
            return Stats(blocked + len(self._calls), len(self._running) + len(self.lanes.tickets), self._busy_rows, self.steps,
                         len(self._waiting) + len(self._calls), self._prefilling, self.preemptions)

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

    # --- admission (under the lock) --------------------------------------------------------------
    def _free_kv(self) -> int | None:
        return free_slots(self.generator.pool, self.generator.prefix_cache)

    def _admissible(self, extra: Sequence[Ticket] = ()) -> int:
        """`admissible` over the queue (and ``extra`` after it), at the rows and KV free now."""
        queue = [*self._waiting, *extra]
        return admissible([t.width for t in queue], self.max_rows - self._busy_rows, self._busy_rows > 0,
                          [t.kv.start for t in queue], self._free_kv())

    def _check_open(self) -> None:
        if self._stop or self._expired:
            raise ShuttingDown("server shutting down: not accepting new work")

    def _check_room(self, ticket: Ticket) -> None:
        """Refuse ``ticket`` only when it could not be admitted either (it would wait) and
        ``max_waiting`` requests already wait (queued calls count as waiting)."""
        self._check_open()
        queued = len(self._waiting)
        waiting = queued - self._admissible() + len(self._calls)
        if self._admissible([ticket]) > queued or waiting < self.max_waiting:
            return
        ahead = sum(t.width for t in self._waiting) - (self.max_rows - self._busy_rows)
        raise Overloaded(waiting, self.max_waiting, retry_after(ahead, self.drain.rate(self.clock()), self.max_rows))

    def _take_admissible(self) -> list[Ticket]:  # the head that fits (`admissible`), within the prefill budget
        tokens = [prefill_tokens(t.rows_to_admit) for t in itertools.islice(self._waiting, self._admissible())]
        return [self._waiting.popleft() for _ in range(within_budget(tokens, self.max_prefill_tokens))]

    # --- the loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._calls and not self._running and not self.lanes.tickets:
                    if self._deadline is not None:
                        self.drained.set()
                    if self._worked:
                        self._worked = False
                        self._idle()
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
                self._prefilling = sum(t.width for t in admit if not t.beams)
                self._busy_rows += sum(t.width for t in admit)
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # handed to the caller, who decides
                        future.set_exception(exc)
            for ticket in admit:  # each one's first tokens go out as soon as its prompt is prefilled,
                self._admit(ticket)  # not after the others' prefills (time to first token)
                self._deliver()
            with self._wake:
                self._prefilling = 0
            self._cancel_requested()
            for kind, batch in list(self._batches.items()):
                if batch.rows:
                    self._make_room(kind, batch)
                    self._step(kind, batch)
            for ticket in self.lanes.turn(any(b.rows for b in self._batches.values())):
                self.lanes.advance(ticket)
            self._deliver()
            with self._wake:
                self._busy_rows = self._rows_now()
        self._shutdown()

    def _rows_now(self) -> int:
        return sum(len(b.rows) for b in self._batches.values()) + self.lanes.rows

    def _idle(self) -> None:
        """The loop has nothing to do: give back what a burst made the pool and allocator grow to."""
        with contextlib.suppress(Exception):
            shrink_pool(self.generator)
        trim()

    def _admit(self, ticket: Ticket) -> None:
        if ticket.cancelled:
            for row in ticket.rows:  # a preempted request's rows carry state: they end here
                if not row.state.done:
                    row.state.finish("cancelled")
            self._finish(ticket)
            return
        ticket.admitted = next(self._order)
        if ticket.beams:
            self.lanes.start(ticket)
            return
        batch = self._batches.get(ticket.kind)
        if batch is None:
            batch = self._batches[ticket.kind] = self.generator.new_batch(ticket.kind)
        try:
            rows = batch.admit(ticket.rows_to_admit)
        except Exception as exc:
            self._fail(ticket, exc)
            return
        if ticket.resuming:  # a preempted request comes back: its resumed rows take their places
            for i, row in zip(ticket.resuming, rows, strict=True):
                ticket.rows[i] = row
            ticket.resuming = []
        else:
            ticket.rows = rows
        ticket.rows_to_admit = []
        self._running.append(ticket)

    def _cancel_requested(self) -> None:
        with self._wake:  # a cancelled request still queued leaves the queue now
            gone = [t for t in self._waiting if t.cancelled]
            for t in gone:
                self._waiting.remove(t)
        for ticket in gone:
            self._admit(ticket)  # ends it (a preempted one's rows included)
        self.lanes.cancel_requested()
        for ticket in self._running:
            batch = self._batches.get(ticket.kind)
            if ticket.done or batch is None:
                continue
            if ticket.cancelled:
                live = [r for r in ticket.rows if not r.state.done]
                if live:
                    batch.cancel(live)
            elif ticket.ending:
                ending, ticket.ending = ticket.ending, set()
                rows = [ticket.rows[i] for i in sorted(ending) if i < len(ticket.rows) and not ticket.rows[i].state.done]
                if rows:
                    batch.cancel(rows, "stop")

    def _make_room(self, kind: type, batch: DecodeBatch) -> None:
        """Free the KV this step of ``batch`` will write, if the pool cannot hold it: first what
        only the prefix cache holds, then the youngest requests, preempted (`_preempt`)."""
        pool, cache = self.generator.pool, self.generator.prefix_cache

        def short() -> int:
            live = sum(1 for r in batch.rows if not r.state.done)
            return shortfall(pool, streams(kind) * live * max(1, self._draft))

        if short() > 0 and cache is not None:
            cache.evict(short())
        while short() > 0:
            victims = sorted((t for t in self._running if not t.done and any(not r.state.done for r in t.rows)),
                             key=lambda t: -t.admitted)
            if len(victims) < 2:  # the last request runs on: it fits alone (checked at submit)
                return
            self._preempt(victims[0])

    def _preempt(self, ticket: Ticket) -> None:
        """Take ``ticket``'s live rows out of their batch, their state kept, and queue it first,
        to be recomputed and carry on when admitted again."""
        batch = self._batches[ticket.kind]
        live = [i for i, r in enumerate(ticket.rows) if not r.state.done]
        ticket.rows_to_admit = batch.detach([ticket.rows[i] for i in live])
        ticket.resuming = live
        ticket.kv = kv_need(ticket.rows_to_admit, self._draft, streams(ticket.kind))
        ticket.preemptions += 1
        self._running.remove(ticket)
        with self._wake:
            self.preemptions += 1
            self._waiting.appendleft(ticket)
        log.info("KV pool full: preempted a request's %d rows (recomputed when admitted again)", len(live))

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

    def _finish(self, ticket: Ticket, found: Sequence[Completion] | None = None) -> None:
        """End ``ticket`` with its rows' completions, or a beam search's hypotheses (``found``)."""
        ticket.done = True
        with self._wake:
            self.drain.record(self.clock(), len(ticket.rows) if found is None else ticket.beams)
        with contextlib.suppress(BudgetExceeded):
            ticket.ledger.charge(seconds=time.perf_counter() - ticket.submitted)
        completions = tuple(completion(r.state) for r in ticket.rows) if found is None else tuple(found)
        ticket.sink(Finished(completions))

    def _fail(self, ticket: Ticket, exc: BaseException) -> None:
        ticket.done = True
        ticket.sink(Failed(exc))

    def _expire(self) -> None:
        """The drain's deadline passed: end everything queued and running, each with its error."""
        counts = self._end_all(ended())
        log.warning("shutdown timeout: ended %d running, %d beam searches and %d queued requests", *counts)

    def _shutdown(self) -> None:
        self._end_all(ShuttingDown("server shutting down"))
        for batch in self._batches.values():
            with contextlib.suppress(Exception):
                batch.close()
        self._batches.clear()

    def _end_all(self, error: BaseException) -> tuple[int, int, int]:
        """Fail everything queued, running and searching with ``error`` (`metaloom.server.ending`);
        returns how many of each (running, beam searches, queued) were ended."""
        with self._wake:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
        counts = end_all(error, waiting, calls, self._running, self._batches, self.lanes, self._fail)
        self._running = []
        with self._wake:
            self._busy_rows = self._rows_now()
        return counts
