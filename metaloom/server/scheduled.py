"""The `Generator` protocol over the scheduler: what strategies run against inside the server.

A strategy's `generate` call becomes tickets in the shared decode loop, so its samples are
batched with every other request's (continuous batching across strategies and plain requests);
`score` runs on the loop thread between steps; `render` only needs the tokenizer. ``on_done``
hears of every finished call (the server's progress events).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence

from metaloom.generator.types import Completion, Message, Prompt, Request, Scored, StreamChunk, TokenIds
from metaloom.ledger import Ledger
from metaloom.server.scheduler import Event, Failed, Finished, Scheduler, Ticket
from metaloom.server.tickets import Cancelled

__all__ = ["Cancelled", "ScheduledGenerator"]


class ScheduledGenerator:
    def __init__(self, scheduler: Scheduler, on_done: Callable[[tuple[Completion, ...]], None] | None = None) -> None:
        self.scheduler = scheduler
        self.engine = scheduler.generator
        self.capabilities = self.engine.capabilities
        self.name = self.engine.name
        self.on_done = on_done
        self.tickets: list[Ticket] = []  # so a cancelled request can cancel its strategy's work
        self.cancelled = False

    def render(self, messages: Sequence[Message]) -> str:
        return self.engine.render(messages)

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        inboxes: list[queue.SimpleQueue[Event]] = []
        tickets = []
        try:
            for r in requests:  # all validated and queued before any waits: they decode together
                inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
                tickets.append(self._submit(r, ledger, inbox))
                inboxes.append(inbox)
            out = [list(_wait(inbox)) for inbox in inboxes]
        except BaseException:
            for t in tickets:
                t.cancel()
            raise
        if self.on_done is not None:
            for completions in out:
                self.on_done(tuple(completions))
        return out

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        inbox: queue.SimpleQueue[Event] = queue.SimpleQueue()
        ticket = self._submit(request, ledger, inbox)  # a bad request raises at the call
        return self._stream(ticket, inbox)

    def _stream(self, ticket: Ticket, inbox: queue.SimpleQueue[Event]) -> Iterator[StreamChunk]:
        try:
            while True:
                event = inbox.get()
                if isinstance(event, StreamChunk):
                    yield event
                elif isinstance(event, Failed):
                    raise event.error
                else:
                    if self.on_done is not None:
                        self.on_done(event.completions)
                    return
        finally:
            ticket.cancel()  # closed early: the rows leave at the next step (a no-op when done)

    def score(self, prompt: Prompt, continuations: Sequence[str | TokenIds], *, ledger: Ledger) -> list[Scored]:
        if self.cancelled:
            raise Cancelled("the request was cancelled")
        result: list[Scored] = self.scheduler.call(lambda: self.engine.score(prompt, continuations, ledger=ledger)).result()
        return result

    def cancel(self) -> None:
        """Cancel everything this generator has in flight (the client went away); later calls
        raise `Cancelled`, so the strategy stops instead of spending more."""
        self.cancelled = True
        for t in self.tickets:
            t.cancel()

    def _submit(self, request: Request, ledger: Ledger, inbox: queue.SimpleQueue[Event]) -> Ticket:
        if self.cancelled:
            raise Cancelled("the request was cancelled")
        ticket = self.scheduler.submit(request, ledger, inbox.put)
        self.tickets = [t for t in self.tickets if not t.done] + [ticket]
        return ticket


def _wait(inbox: queue.SimpleQueue[Event]) -> tuple[Completion, ...]:
    while True:
        event = inbox.get()
        if isinstance(event, Finished):
            return event.completions
        if isinstance(event, Failed):
            raise event.error
