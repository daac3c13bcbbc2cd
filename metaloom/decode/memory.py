"""The KV memory a request's rows hold: the ledger's ``kv_bytes_peak`` (`metaloom.ledger`).

What is counted. The native engine's rows are slot tables into a `KVPool`
(`metaloom.models.engine.cache`): a slot is one token's keys and values over every layer,
``pool.bytes_per_slot`` bytes. Rows forked from one prompt share its slots, and the prefix cache
hands stored slots to new rows, so a set of rows holds its *distinct* slots: n samples of a
P-token prompt with m tokens each of their own hold P + n·m slots, not n·(P + m). Slots the
prefix cache keeps after a row has left are the cache's, no request's. A token's KV is written
when the token is fed, and the last token drawn is never fed: a P-token prompt that generates M
tokens peaks at P + M - 1 slots. A model of two streams (contrastive decoding's amateur,
guidance's unconditional stream: `PairCache`) and a draft model's own cache add their slots at
their own pools' bytes per slot.

How, cheaply (`BatchMemory`, for the decode loop). Every position of a decode-batch row past the
row's length when it joined the batch was written by that row alone: `PagedKVCache.prepare`
takes fresh slots, and rows stay or leave by `fork` of distinct rows, which shares nothing new.
So the rows of one ledger hold

    distinct(slots below each row's join length) + Σ (length − join length)

slots. The first term is counted with `np.unique` only when a ledger's rows join or leave
(rare), over that ledger's rows alone; the second is an O(rows) numpy sum after every forward,
where memory can grow. Leaving only lowers memory, so measuring after every join and every
forward (before a speculative step rolls its rejected drafts back: their KV was written and
held) finds the peak exactly.

Caches that keep no slots (the HF adapter, the toy models of the tests) cannot be measured:
their ledgers get ``kv_bytes_peak`` unknown, never a misleading 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from metaloom.decode.contrastive import PairCache
from metaloom.errors import BudgetExceeded
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache

FIGURE = "kv_bytes_peak"


def streams(cache: object) -> list[PagedKVCache] | None:
    """The paged caches ``cache`` is made of (itself; both of a `PairCache`), or None where a
    stream keeps no slots and its memory cannot be measured."""
    if isinstance(cache, PagedKVCache):
        return [cache]
    if isinstance(cache, PairCache):
        first, second = streams(cache.primary), streams(cache.secondary)
        return None if first is None or second is None else first + second
    return None


def span_slots(cache: PagedKVCache, lo: np.ndarray, hi: np.ndarray,
               rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(slot ids, their rows) of positions ``lo[i] .. hi[i] - 1`` of row ``rows[i]`` (default:
    every row in order), row-major."""
    index = np.arange(cache.batch) if rows is None else rows
    width = int(hi.max()) if hi.size else 0
    at = np.arange(width)
    mask = (at[None, :] >= lo[:, None]) & (at[None, :] < hi[:, None])
    owner = np.broadcast_to(index[:, None], mask.shape)
    return cache.slots[index, :width][mask], owner[mask]


def held_bytes(cache: object) -> int | None:
    """The KV bytes every row of ``cache`` holds together (distinct slots × bytes per slot,
    per stream); None where it cannot be measured. O(rows × length): for one-off measures
    (a scoring call, a beam step), not for every step of the decode loop."""
    parts = streams(cache)
    if parts is None:
        return None
    total = 0
    for part in parts:
        slots, _ = span_slots(part, np.zeros(part.batch, dtype=np.int64), part.host_lengths())
        total += int(np.unique(slots).size) * part.pool.bytes_per_slot
    return total


def beyond_bytes(cache: object, start: np.ndarray) -> int | None:
    """The KV bytes of the distinct slots at positions ``start[b] ..`` of the rows of a
    one-stream cache (beams past their prompts); None where it cannot be measured."""
    parts = streams(cache)
    if parts is None or len(parts) != 1:
        return None
    slots, _ = span_slots(parts[0], start, parts[0].host_lengths())
    return int(np.unique(slots).size) * parts[0].pool.bytes_per_slot


def charge_peak(ledger: Ledger, held: int | None) -> None:
    """Charge ``held`` bytes as a peak (the ledger keeps the larger), or the figure unknown.
    Raises `BudgetExceeded` after recording, as `Ledger.charge` does."""
    if held is None:
        ledger.charge(unknown=frozenset({FIGURE}))
    else:
        ledger.charge(kv_bytes_peak=held)


class BatchMemory:
    """The KV bytes each ledger's rows hold in one decode batch, followed as rows join, step
    and leave (see the module docstring); each ledger is charged its new highs. Its rows stay
    aligned with the batch's cache rows: `join` appends, `select` keeps, as the batch does.

    ``joined[s][b]``: row b's length in stream s when it joined; ``drafted``: a draft model's
    cache, whose rows share nothing (each feeds its own context), counted as Σ lengths."""

    def __init__(self) -> None:
        self.joined: list[np.ndarray] = []
        self.ledgers: list[Ledger] = []  # row b is charged to ledgers[owner[b]]
        self.owner = np.zeros(0, dtype=np.int64)
        self.shared: dict[int, int] = {}  # per ledger id: bytes of its rows' distinct slots below their join lengths
        self.dirty: set[int] = set()  # ledger ids whose rows came or went: their shared part is counted again
        self.high: dict[int, int] = {}  # per ledger id: the most this batch has charged it
        self.unknown: set[int] = set()  # ledger ids already told the figure is unknown here

    def join(self, cache: object, ledgers: Sequence[Ledger]) -> None:
        """Rows of ``cache`` (before it joins the batch's) are appended, charged to ``ledgers``."""
        parts = streams(cache)
        lengths = [p.host_lengths() for p in parts] if parts is not None else []
        if not self.joined or len(self.joined) != len(lengths):
            self.joined = [np.zeros(0, dtype=np.int64) for _ in lengths]
        self.joined = [np.concatenate([j, n]) for j, n in zip(self.joined, lengths, strict=True)]
        self._own(self._owners() + list(ledgers), {id(ledger) for ledger in ledgers})

    def select(self, positions: Sequence[int]) -> None:
        """Keep only the rows at ``positions`` (the batch's `keep`)."""
        at = np.asarray(list(positions), dtype=np.int64)
        self.joined = [j[at] for j in self.joined]
        owners = self._owners()
        kept = set(at.tolist())
        self._own([owners[i] for i in at.tolist()], {id(owners[i]) for i in range(len(owners)) if i not in kept})

    def measure(self, cache: object, drafted: object = None) -> list[tuple[Ledger, int]]:
        """Each ledger whose rows now hold more than this batch has reported, with what they
        hold: the caller charges them (`charge_highs`, or with the step's other charges, one
        charge per ledger per step: a server's batch has a ledger per request)."""
        parts = streams(cache)
        extra = None
        if drafted is not None:
            extra = streams(drafted)
            if extra is None or len(extra) != 1:  # a draft model's cache that keeps no slots
                parts = None
        if parts is None or len(parts) != len(self.joined):
            self._unknown()
            return []
        if self.dirty:
            self._count_shared(parts)
        # in Python ints: measured every step right after the forward, when each numpy call
        # starts with cold caches (a few rows' sums took a small model's step 0.06 ms as arrays)
        tails = [0] * len(self.owner)
        for part, joined in zip(parts, self.joined, strict=True):
            per = part.pool.bytes_per_slot
            for b, (n, j) in enumerate(zip(part.host_lengths().tolist(), joined.tolist(), strict=True)):
                tails[b] += (n - j) * per
        if extra is not None:
            per = extra[0].pool.bytes_per_slot
            for b, n in enumerate(extra[0].host_lengths().tolist()):
                tails[b] += n * per
        own = [0] * len(self.ledgers)
        for b, o in enumerate(self.owner.tolist()):
            own[o] += tails[b]
        highs = []
        for ledger, tail in zip(self.ledgers, own, strict=True):
            now = self.shared[id(ledger)] + tail
            if now > self.high.get(id(ledger), 0):
                self.high[id(ledger)] = now
                highs.append((ledger, now))
        return highs

    # --- bookkeeping ------------------------------------------------------------------------
    def _owners(self) -> list[Ledger]:
        return [self.ledgers[i] for i in self.owner.tolist()]

    def _own(self, owners: list[Ledger], changed: set[int]) -> None:
        """Rows are now charged to ``owners``; the ledgers ``changed`` gained or lost rows."""
        index: dict[int, int] = {}
        self.ledgers = []
        for ledger in owners:
            if id(ledger) not in index:
                index[id(ledger)] = len(self.ledgers)
                self.ledgers.append(ledger)
        self.owner = np.array([index[id(ledger)] for ledger in owners], dtype=np.int64)
        # forget ledgers with no rows left: a long-lived batch (the server's) sees many, and the
        # id of one that was collected may come back as another's
        self.high = {k: v for k, v in self.high.items() if k in index}
        self.shared = {k: v for k, v in self.shared.items() if k in index}
        self.unknown &= index.keys()
        # only the ledgers whose rows changed are counted again (a server request whose sample
        # finished, not every request in the batch)
        self.dirty = (self.dirty | changed) & index.keys()

    def _count_shared(self, parts: Sequence[PagedKVCache]) -> None:
        """For each dirty ledger, the bytes of the distinct slots below its rows' join lengths."""
        where = {id(ledger): i for i, ledger in enumerate(self.ledgers)}
        for key in self.dirty:
            rows = np.flatnonzero(self.owner == where[key])
            total = 0
            for part, joined in zip(parts, self.joined, strict=True):
                slots, _ = span_slots(part, np.zeros(len(rows), dtype=np.int64), joined[rows], rows)
                total += int(np.unique(slots).size) * part.pool.bytes_per_slot
            self.shared[key] = total
        self.dirty = set()

    @staticmethod
    def charge_highs(highs: Sequence[tuple[Ledger, int]]) -> None:
        """Charge `measure`'s new highs, each its own charge (never raising: the decode loop
        asks each ledger afterwards)."""
        for ledger, now in highs:
            with contextlib.suppress(BudgetExceeded):
                ledger.charge(kv_bytes_peak=now)

    def _unknown(self) -> None:
        for ledger in self.ledgers:
            if id(ledger) not in self.unknown:
                self.unknown.add(id(ledger))
                with contextlib.suppress(BudgetExceeded):
                    ledger.charge(unknown=frozenset({FIGURE}))
