"""A request made into a scheduler `Ticket`, in the caller's thread (`Scheduler.submit`): held to
the server's limits, planned (a bad request raises here, before any compute), its KV need
reckoned (`metaloom.server.admission`), and refused when the pool could never hold it, even alone.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from metaloom.decode.specs import BeamParams, GuidanceParams
from metaloom.errors import InvalidParameter
from metaloom.generator.local import LocalGenerator
from metaloom.generator.plan import plan
from metaloom.generator.types import Completion, Request
from metaloom.ledger import Ledger
from metaloom.server.admission import beam_need, kv_need, too_large
from metaloom.server.limits import Limits
from metaloom.server.tickets import Sink, Ticket

# a beam search's forwards over a plan (`metaloom.server.lanes.BeamLanes.search`)
Search = Callable[[Any, BeamParams, Ledger], Generator[None, None, list[Completion]]]


def ticket_for(generator: LocalGenerator, limits: Limits, request: Request, ledger: Ledger, sink: Sink, *,
               draft: int, search: Search) -> Ticket:
    """``request``'s ticket, its chunks and end going to ``sink``; ``draft``: the positions a
    speculative step writes past the pending token; ``search``: how an admitted beam search runs."""
    limits.check_rows(request.params.n, 1)  # before any row is made
    p = plan(generator, request)  # a bad request raises here, in the caller's thread
    prompt_limit = limits.prompt_tokens(generator.model.max_context)
    if len(p.ids) > prompt_limit:
        raise InvalidParameter("prompt", f"{len(p.ids)} tokens", f"at most {prompt_limit} tokens "
                               "(server limit max_prompt_tokens)")
    if isinstance(request.decoder, BeamParams):
        spec, beams = request.decoder, request.decoder.beams
        limits.check_beams(beams)
        ticket = Ticket([], BeamParams, ledger, sink, kv=beam_need(len(p.ids), beams, request.params.max_tokens),
                        beams=beams)
        ticket.start = lambda: search(p, spec, ledger)
    else:
        rows = p.rows(ledger, generator.model.device, None)
        ticket = Ticket(rows, p.kind, ledger, sink, kv=kv_need(rows, draft, streams(p.kind)))
    check_fits(generator, ticket, request)
    return ticket


def check_fits(generator: LocalGenerator, ticket: Ticket, request: Request) -> None:
    """Refuse a request whose KV could never fit the pool, even alone (caller's thread)."""
    pool = generator.pool
    if pool is None or pool.max_slots is None:
        return
    error = too_large(ticket.kv, pool.max_slots - 1, pool.bytes_per_slot, ticket.width, request.params.max_tokens)
    if error is not None:
        raise error


def streams(kind: type) -> int:
    """KV streams a row of this decoder writes to the engine's pool (guidance's unconditional
    stream shares it; contrastive decoding's amateur keeps a pool of its own)."""
    return 2 if kind is GuidanceParams else 1
