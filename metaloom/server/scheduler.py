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
own beside the batches (`LocalGenerator.beam_steps`) with a fair share: while rows decode, one
beam search takes one forward per loop iteration, in turn, beside one step of each batch (so a
plain request's steps are at most about twice as far apart as without beams); with nothing else
running every beam search steps. Beam searches and plain requests all move together, and a plain
request is admitted while they run (no head-of-line blocking).

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
from metaloom.decode.specs import BeamParams, GuidanceParams
from metaloom.errors import BudgetExceeded, InvalidParameter
from metaloom.generator.local import LocalGenerator, chunks, completion
from metaloom.generator.plan import plan
from metaloom.generator.types import Request
from metaloom.ledger import Ledger
from metaloom.server.admission import (
    DrainRate,
    Overloaded,
    admissible,
    beam_need,
    free_slots,
    kv_need,
    retry_after,
    shortfall,
    too_large,
)
from metaloom.server.limits import Limits
from metaloom.server.memory import shrink_pool, trim
from metaloom.server.tickets import Event, Failed, Finished, ShuttingDown, Sink, Stats, Ticket, chunk_of, ended

__all__ = ["Event", "Failed", "Finished", "Overloaded", "Scheduler", "ShuttingDown", "Ticket"]

log = logging.getLogger("metaloom.server")


class Scheduler:
    """``max_rows``: rows decoded together at most (admission waits for room); ``max_waiting``:
    requests that cannot be admitted before `submit` refuses with `Overloaded`; ``limits``: what
    one request may ask for (`Limits`). ``clock``: seconds, for the drain rate behind Retry-After."""

    def __init__(self, generator: LocalGenerator, *, max_rows: int = 64, max_waiting: int = 256,
                 on_step: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 limits: Limits | None = None) -> None:
        if max_rows < 1:
            raise InvalidParameter("max_rows", max_rows, ">= 1")
        if max_waiting < 0:
            raise InvalidParameter("max_waiting", max_waiting, ">= 0")
        self.generator = generator
        self.max_rows, self.max_waiting = max_rows, max_waiting
        self.limits = limits or Limits()
        self.on_step = on_step  # called with the batch size after each step (metrics)
        spec = generator.speculative
        self._draft = 0 if spec is None else spec.num_draft + 1  # positions a step may write past the pending token
        self._waiting: deque[Ticket] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._running: list[Ticket] = []  # tickets with rows in a batch
        self._lanes: list[Ticket] = []  # beam searches running beside the batches
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
        self.limits.check_rows(request.params.n, 1)  # before any row is made
        p = plan(self.generator, request)  # a bad request raises here, in the caller's thread
        prompt_limit = self.limits.prompt_tokens(self.generator.model.max_context)
        if len(p.ids) > prompt_limit:
            raise InvalidParameter("prompt", f"{len(p.ids)} tokens", f"at most {prompt_limit} tokens "
                                   "(server limit max_prompt_tokens)")
        if isinstance(request.decoder, BeamParams):
            spec, beams = request.decoder, request.decoder.beams
            self.limits.check_beams(beams)
            ticket = Ticket([], BeamParams, ledger, sink, kv=beam_need(len(p.ids), beams, request.params.max_tokens),
                            beams=beams)
            ticket.start = lambda: self._beam_steps(p, spec, ledger)
        else:
            rows = p.rows(ledger, self.generator.model.device, None)
            ticket = Ticket(rows, p.kind, ledger, sink, kv=kv_need(rows, self._draft, _streams(p.kind)))
        self._check_fits(ticket, request)
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
            return Stats(blocked + len(self._calls), len(self._running) + len(self._lanes), self._busy_rows, self.steps,
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

    def _check_fits(self, ticket: Ticket, request: Request) -> None:
        """Refuse a request whose KV could never fit the pool, even alone (caller's thread)."""
        pool = self.generator.pool
        if pool is None or pool.max_slots is None:
            return
        error = too_large(ticket.kv, pool.max_slots - 1, pool.bytes_per_slot, ticket.width, request.params.max_tokens)
        if error is not None:
            raise error

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

    def _take_admissible(self) -> list[Ticket]:
        n = self._admissible()
        return [self._waiting.popleft() for _ in range(n)]

    # --- the loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._calls and not self._running and not self._lanes:
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
            for ticket in admit:
                self._admit(ticket)
            with self._wake:
                self._prefilling = 0
            if admit:  # their first tokens go out now, not after the next step (time to first token)
                self._deliver()
            self._cancel_requested()
            for kind, batch in list(self._batches.items()):
                if batch.rows:
                    self._make_room(kind, batch)
                    self._step(kind, batch)
            for ticket in self._lanes_now():
                self._advance(ticket)
            self._deliver()
            with self._wake:
                self._busy_rows = self._rows_now()
        self._shutdown()

    def _lanes_now(self) -> list[Ticket]:
        """The beam searches that step this iteration: a fair share beside the decode batches,
        one of them in turn while rows decode (so plain requests' steps are at most twice as far
        apart as without beams), every one when nothing else runs."""
        if not self._lanes:
            return []
        if not any(b.rows for b in self._batches.values()):
            return list(self._lanes)
        self._lanes.append(self._lanes.pop(0))  # round robin
        return [self._lanes[-1]]

    def _rows_now(self) -> int:
        return sum(len(b.rows) for b in self._batches.values()) + sum(t.beams for t in self._lanes)

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
            assert ticket.start is not None
            ticket.steps = ticket.start()
            self._lanes.append(ticket)
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
        for ticket in [t for t in self._lanes if t.cancelled]:
            self._advance(ticket)  # a cancelled beam search ends now, whoever's turn it is
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
            return shortfall(pool, _streams(kind) * live * max(1, self._draft))

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
        ticket.kv = kv_need(ticket.rows_to_admit, self._draft, _streams(ticket.kind))
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

    def _beam_steps(self, p: Any, spec: BeamParams, ledger: Ledger) -> Any:
        steps = self.generator.beam_steps([p], spec, ledger)
        found = yield from steps
        return found[0]

    def _advance(self, ticket: Ticket) -> None:
        """One forward of a running beam search (its lane); its hypotheses once it ends."""
        assert ticket.steps is not None
        if ticket.cancelled:
            ticket.steps.close()
            self._lanes.remove(ticket)
            ticket.done = True
            ticket.sink(Finished(()))
            return
        try:
            next(ticket.steps)
            return
        except StopIteration as end:
            found = end.value
        except Exception as exc:
            self._lanes.remove(ticket)
            self._fail(ticket, exc)
            return
        self._lanes.remove(ticket)
        ticket.first_token_at = time.perf_counter()
        for i, c in enumerate(found):
            ticket.sink(chunk_of(c, i))
        ticket.done = True
        with self._wake:
            self.drain.record(self.clock(), ticket.beams)
        with contextlib.suppress(BudgetExceeded):
            ticket.ledger.charge(seconds=time.perf_counter() - ticket.submitted)
        ticket.sink(Finished(tuple(found)))

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
        """Fail everything queued, running and searching with ``error``; returns how many of each
        (running, beam searches, queued) were ended."""
        with self._wake:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
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
        for ticket in self._lanes:
            if ticket.steps is not None:
                with contextlib.suppress(Exception):
                    ticket.steps.close()
        counts = (len(running), len(self._lanes), len(waiting))
        for ticket in [*waiting, *running, *self._lanes]:
            if not ticket.done:
                self._fail(ticket, error)
        self._running, self._lanes = [], []
        with self._wake:
            self._busy_rows = self._rows_now()
        return counts


def _streams(kind: type) -> int:
    """KV streams a row of this decoder writes to the engine's pool (guidance's unconditional
    stream shares it; contrastive decoding's amateur keeps a pool of its own)."""
    return 2 if kind is GuidanceParams else 1
