"""Admission to the decode loop: rows, KV memory, and when a refused client should come back.

Rows: at most ``max_rows`` are decoded together; a queued request joins at the next step
boundary when its rows fit what is free (first in, first out: no overtaking), and one wider than
every row still goes in alone when nothing else runs (`admissible`).

KV memory, as vLLM's block manager counts it (Kwon et al. 2023) with one-token pages: a request
holds its prompt once (its samples fork it, `metaloom.models.engine.cache`) and one slot per
generated token per row (`kv_need`). A request whose worst case, every row at ``max_tokens``,
exceeds the pool's limit can never be served and is refused before any work (`too_large`); one
that fits the limit waits until its prompt and first tokens fit what is free now, with a
watermark to spare (optimistic admission). A running row that later finds the pool full is
preempted, not failed (`metaloom.server.scheduler`): its slots are freed and it is recomputed
when admitted again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.decode.joining import NewRow
from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.models.engine.pool import KVPool
from metaloom.prefix.pool import PrefixCache


class Overloaded(MetaloomError):
    """The scheduler's queue is full; try again after ``retry_after`` seconds."""

    def __init__(self, waiting: int, limit: int, retry_after: int = 1, what: str = "a free decode row") -> None:
        super().__init__(f"server overloaded: {waiting} requests waiting for {what} (limit {limit}); "
                         f"retry after {retry_after} s")
        self.waiting, self.limit, self.retry_after = waiting, limit, retry_after


@dataclass(frozen=True)
class KVNeed:
    """KV slots a request holds: ``start`` once admitted (its prompts and every row's first
    token), ``step`` more at each step (a slot per row, and a speculative draft's), ``worst``
    at most (every row at its ``max_tokens``)."""

    start: int
    step: int
    worst: int


def kv_need(rows: Sequence[NewRow], draft: int = 0, streams: int = 1) -> KVNeed:
    """What ``rows`` (one request's) will hold in the pool: each distinct prompt once (the rows
    of a group fork it), then one slot per generated token per row; ``draft``: the positions a
    speculative step writes past the pending token; ``streams``: 2 for a decoder whose second
    stream shares the pool (guidance's unconditional prompt)."""
    prompts: dict[object, int] = {}
    for r in rows:
        prompts[r.group if r.group is not None else id(r)] = max(len(r.prompt), len(r.secondary or ()))
    prompt = sum(prompts.values())
    per_step = len(rows) * (1 + draft)
    return KVNeed(start=streams * (prompt + per_step), step=streams * per_step,
                  worst=streams * (prompt + sum(r.room + draft for r in rows)))


def beam_need(prompt: int, beams: int, max_tokens: int) -> KVNeed:
    """Beam search's: its prompt once, and each beam's tokens (reserved whole: beams are not
    preempted)."""
    worst = prompt + beams * max_tokens
    return KVNeed(start=worst, step=0, worst=worst)


def too_large(need: KVNeed, limit: int, bytes_per_slot: int, rows: int, max_tokens: int) -> InvalidParameter | None:
    """The error for a request that can never fit the pool's ``limit`` slots (None: it can)."""
    if need.worst <= limit:
        return None
    gib = 2 ** 30
    return InvalidParameter("max_tokens", max_tokens,
                            f"a request whose KV fits the server: {rows} row(s) up to max_tokens need {need.worst:,} KV "
                            f"slots ({need.worst * bytes_per_slot / gib:.2f} GiB), the server's pool holds at most "
                            f"{limit:,} ({limit * bytes_per_slot / gib:.2f} GiB); lower max_tokens or n")


def watermark(limit: int) -> int:
    """Slots admission keeps free for the rows already running (vLLM keeps 1%)."""
    return max(16, limit // 100)


def free_slots(pool: KVPool | None, cache: PrefixCache | None) -> int | None:
    """KV slots free for new requests now (what only the prefix cache holds counts as free: it
    gives it back on demand), less the watermark; None without a bounded pool."""
    if pool is None or pool.max_slots is None:
        return None
    limit = pool.max_slots - 1
    spare = cache.tree.evictable() if cache is not None else 0
    return limit - pool.used_slots + spare - watermark(limit)


def shortfall(pool: KVPool | None, need: int) -> int:
    """Slots missing for ``need`` more in the pool's limit (<= 0: they fit)."""
    if pool is None or pool.max_slots is None:
        return 0
    return need - (pool.max_slots - 1 - pool.used_slots)


def admissible(needs: Sequence[int], free: int, busy: bool, kv: Sequence[int] = (), free_kv: int | None = None) -> int:
    """How many of the queued requests (their row counts ``needs``, first in first out) the loop
    admits at its next step boundary, with ``free`` rows free; ``busy``: rows are running. With
    ``kv`` (each request's `KVNeed.start`) and ``free_kv`` (slots free now, less the watermark),
    a request must fit both. A request waits when it does not fit what is left, and so does
    everything behind it (no overtaking); one wider than every free row (or larger than the
    free KV) still goes in alone when nothing else runs."""
    taken = 0
    for i, need in enumerate(needs):
        slots = kv[i] if i < len(kv) else 0
        fits = need <= free and (free_kv is None or slots <= free_kv)
        if not fits and (taken or busy):
            break
        taken += 1
        free -= need
        if free_kv is not None:
            free_kv -= slots
    return taken


def prefill_tokens(rows: Sequence[NewRow]) -> int:
    """The prompt tokens admitting ``rows`` (one request's) prefills: each distinct prompt once
    (a request's samples share one); none for a beam search (its lane prefills it)."""
    prompts: dict[object, int] = {}
    for r in rows:
        prompts[r.group if r.group is not None else id(r)] = len(r.prompt) + len(r.secondary or ())
    return sum(prompts.values())


def within_budget(tokens: Sequence[int], budget: int) -> int:
    """How many of the admissible requests (their `prefill_tokens`, in queue order) to admit at
    one step boundary: as long as their prompts add up to at most ``budget``, the first always.
    A burst of long prompts is then prefilled over several step boundaries, and the rows already
    running take a step between them instead of waiting for the whole burst (vLLM bounds a
    step's batched tokens for the same reason)."""
    total = 0
    for i, n in enumerate(tokens):
        total += n
        if i and total > budget:
            return i
    return len(tokens)


def retry_after(ahead_rows: int, rows_per_second: float | None, max_rows: int, cap: int = 600) -> int:
    """Seconds a refused client should wait: the time for ``ahead_rows`` rows to leave the loop
    at the observed drain rate, ``ceil(ahead_rows / rows_per_second)``; with no rate observed
    yet, one second per ``max_rows`` rows ahead. ``ahead_rows`` are the rows queued before it
    that do not fit what is free now: once they have joined the loop, a retry is at the head of
    the queue and accepted (its own rows then wait their turn there, not outside). An integer
    in ``1 .. cap`` (HTTP Retry-After)."""
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
