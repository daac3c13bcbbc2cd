"""Beam searches beside the scheduler's decode batches (`metaloom.server.scheduler`).

Beam search reorders its rows every step, so it cannot share a batch; it runs as a lane of its
own beside the batches (`LocalGenerator.beam_steps`) with a fair share: while rows decode, one
beam search takes one forward per loop iteration, in turn, beside one step of each batch (so a
plain request's steps are at most about twice as far apart as without beams); with nothing else
running every beam search steps. Beam searches and plain requests all move together, and a plain
request is admitted while they run (no head-of-line blocking).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from metaloom.decode.specs import BeamParams
from metaloom.generator.local import LocalGenerator
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.server.tickets import Finished, Ticket, chunk_of


class BeamLanes:
    """The beam searches running, each a generator that takes one forward per ``next``; used on
    the scheduler's loop thread only. ``finish(ticket, found)`` ends a search with its
    hypotheses and ``fail(ticket, error)`` with an error, as the scheduler ends any ticket."""

    def __init__(self, generator: LocalGenerator, finish: Callable[[Ticket, Sequence[Completion]], None],
                 fail: Callable[[Ticket, BaseException], None]) -> None:
        self.generator = generator
        self.finish, self.fail = finish, fail
        self.tickets: list[Ticket] = []

    def search(self, p: Any, spec: BeamParams, ledger: Ledger) -> Generator[None, None, list[Completion]]:
        """The forwards of a beam search over plan ``p`` (a `Ticket.start`); its hypotheses at the end."""
        steps = self.generator.beam_steps([p], spec, ledger)
        found = yield from steps
        return found[0]

    def start(self, ticket: Ticket) -> None:
        """An admitted beam search takes its lane (its first forward at its first turn)."""
        assert ticket.start is not None
        ticket.steps = ticket.start()
        self.tickets.append(ticket)

    @property
    def rows(self) -> int:
        return sum(t.beams for t in self.tickets)

    def turn(self, batches_busy: bool) -> list[Ticket]:
        """The beam searches that step this iteration: a fair share beside the decode batches,
        one of them in turn while rows decode (so plain requests' steps are at most twice as far
        apart as without beams), every one when nothing else runs."""
        if not self.tickets:
            return []
        if not batches_busy:
            return list(self.tickets)
        self.tickets.append(self.tickets.pop(0))  # round robin
        return [self.tickets[-1]]

    def cancel_requested(self) -> None:
        for ticket in [t for t in self.tickets if t.cancelled]:
            self.advance(ticket)  # a cancelled beam search ends now, whoever's turn it is

    def advance(self, ticket: Ticket) -> None:
        """One forward of a running beam search (its lane); its hypotheses once it ends."""
        assert ticket.steps is not None
        if ticket.cancelled:
            ticket.steps.close()
            self.tickets.remove(ticket)
            ticket.done = True
            ticket.sink(Finished(()))
            return
        try:
            next(ticket.steps)
            return
        except StopIteration as end:
            found = end.value
        except Exception as exc:
            self.tickets.remove(ticket)
            self.fail(ticket, exc)
            return
        self.tickets.remove(ticket)
        ticket.first_token_at = time.perf_counter()
        for i, c in enumerate(found):
            ticket.sink(chunk_of(c, i))
        self.finish(ticket, found)

    def end(self) -> list[Ticket]:
        """Stop every search (shutting down); returns their tickets, for the caller to fail."""
        for ticket in self.tickets:
            if ticket.steps is not None:
                with contextlib.suppress(Exception):
                    ticket.steps.close()
        ended, self.tickets = self.tickets, []
        return ended
