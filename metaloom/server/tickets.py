"""A submitted request as the scheduler holds it (`Ticket`), and the events its caller hears."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from metaloom.decode.joining import NewRow, Row
from metaloom.errors import MetaloomError
from metaloom.generator.types import Completion, StreamChunk
from metaloom.ledger import Ledger
from metaloom.server.admission import KVNeed


class Cancelled(MetaloomError):
    """The request this work was for has gone (its client disconnected)."""


class ShuttingDown(MetaloomError):
    """The server is shutting down: it admits nothing new, and what ran past the drain's
    deadline was ended (HTTP 503)."""


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
    """One submitted request: its rows to admit (or, for beam search, its beams: ``beams``
    and ``start`` the search once admitted), its rows once admitted, and where its events go.
    ``sink`` is called on the loop thread, so it must only hand the event over (a queue put).
    ``kv``: the KV slots it will hold (`metaloom.server.admission.kv_need`)."""

    rows_to_admit: list[NewRow]
    kind: type
    ledger: Ledger
    sink: Sink
    kv: KVNeed = field(default_factory=lambda: KVNeed(0, 0, 0))
    beams: int = 0
    start: Callable[[], Generator[None, None, list[Completion]]] | None = None
    submitted: float = field(default_factory=time.perf_counter)
    rows: list[Row] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    first_token_at: float | None = None
    admitted: int = 0  # the loop's admission counter when it joined (the youngest is preempted first)
    resuming: list[int] = field(default_factory=list)  # preempted: indices in ``rows`` its resumed rows replace
    preemptions: int = 0
    steps: Generator[None, None, list[Completion]] | None = None  # a running beam search

    @property
    def width(self) -> int:
        """Decode rows it takes once admitted."""
        return self.beams or len(self.rows_to_admit)

    ending: set[int] = field(default_factory=set)  # rows the caller asked to end (finish "stop")

    def cancel(self) -> None:
        """Ask the loop to end this request's rows at the next step boundary (thread-safe)."""
        self.cancelled = True

    def end_row(self, index: int) -> None:
        """Ask the loop to end row ``index`` (its sample index) at the next step boundary with
        finish reason "stop": its caller has what it needs (thread-safe)."""
        self.ending.add(index)


@dataclass(frozen=True)
class Stats:
    """What the loop is doing now (for /metrics and /health). ``waiting``: requests that cannot be
    admitted at the next step boundary (no room), and calls queued for the loop thread;
    ``queued``: every request not yet in the loop, those about to join included;
    ``running_rows``: rows admitted (those still being prefilled included) and beams searching;
    ``prefilling_rows``: of those, rows being prefilled now; ``preemptions``: requests whose rows
    were taken out for want of KV memory (recomputed when admitted again), since the start."""

    waiting: int
    running_requests: int
    running_rows: int
    steps: int
    queued: int = 0
    prefilling_rows: int = 0
    preemptions: int = 0


def chunk_of(c: Completion, index: int) -> StreamChunk:
    """A finished completion as the one chunk of a search that knows its outputs only at its end."""
    return StreamChunk(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, index, c.error,
                       c.top_logprobs or ())


def ended() -> ShuttingDown:
    return ShuttingDown("server shutting down: the request was ended before it finished "
                        "(shutdown timeout or a second signal)")
