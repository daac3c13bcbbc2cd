"""Ending what the scheduler holds when it shuts down (`Scheduler.begin_drain`'s deadline passed,
or `Scheduler.close`): queued model calls get the error, running rows are cancelled in their
batches (their KV freed), beam searches are stopped, and every ticket not yet done fails with the
error (a 503 in OpenAI's shape; a stream's error event and ``[DONE]``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from metaloom.decode.batch import DecodeBatch
from metaloom.server.lanes import BeamLanes
from metaloom.server.tickets import Ticket


def end_all(error: BaseException, waiting: Sequence[Ticket], calls: Sequence[tuple[Any, Future[Any]]],
            running: Sequence[Ticket], batches: dict[type, DecodeBatch], lanes: BeamLanes,
            fail: Callable[[Ticket, BaseException], None]) -> tuple[int, int, int]:
    """Fail ``waiting`` (taken off the queue), ``calls``, ``running`` and the searches in ``lanes``
    with ``error``; returns how many of each (running, beam searches, queued) were ended."""
    for _, future in calls:
        if future.set_running_or_notify_cancel():
            future.set_exception(error)
    live_tickets = [t for t in running if not t.done]
    for ticket in live_tickets:
        live = [r for r in ticket.rows if not r.state.done]
        batch = batches.get(ticket.kind)
        if live and batch is not None:
            with contextlib.suppress(Exception):
                batch.cancel(live)
    searches = lanes.end()
    counts = (len(live_tickets), len(searches), len(waiting))
    for ticket in [*waiting, *live_tickets, *searches]:
        if not ticket.done:
            fail(ticket, error)
    return counts
