"""The native model's KV cache: a pool of token slots shared by every row that holds them.

Why slots. Tree search forks hundreds of branches from shared prefixes, best-of-N forks N
samples from one prompt, beam search reorders beams every step, and the radix prefix cache
hands a stored prefix to a new request. With one dense [B, H, capacity, D] tensor per cache
each of those copies the shared keys and values once per row. Here a key/value pair is
written once, into a slot of a `KVPool` (per layer: keys and values [slots, H_kv, D]), and a
row is the list of its positions' slots (`PagedKVCache`: a table [B, capacity] of slot ids).
Forking a row copies its slot ids (8 bytes a position) and counts references; the KV stays
where it is. This is paged attention with one-token pages (Kwon et al. 2023, "Efficient Memory
Management for Large Language Model Serving with PagedAttention"; SGLang's token-to-KV pool,
Zheng et al. 2024): no page is ever partly shared, so nothing is ever copied on write — a
slot is written once, by the row that allocated it, before anyone can share it.

Reading: the fused one-token kernels (`metaloom.models.kernels.fused`) read keys through the table;
the PyTorch path gathers a batch's keys into [B, H_kv, L, D] per layer (`PagedKVCache.gather`).

Storage, the scratch slot and reference counts: `metaloom.models.engine.pool`.

Dropped positions (``--kv-policy``, `metaloom.models.engine.dropping`): `evict` takes entries
out of a row's table and closes the gap, so a row's entries are no longer its positions. Per
row, ``shift`` counts the positions dropped (the next token's position is ``length + shift``;
keys stay rotated at their own positions) and ``sinks`` how many leading entries a query attends
at their in-cache positions (StreamingLLM's sinks); ``mass`` ([B, capacity], or None) is the
attention each entry has accumulated, for H2O. Eviction only lets go of references, so a slot
another row (a fork, the prefix cache) still holds stays as it is.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from metaloom.errors import CacheFull, InvalidParameter
from metaloom.models.engine.kv_int8 import dequantize, quantize
from metaloom.models.engine.pool import SCRATCH, KVPool

_SERIALS = itertools.count(1)  # PagedKVCache.serial: ids never reused (id() can be, after collection)


# a cache of at most this many rows writes a forward's slots row by row: right after a forward each
# numpy call starts cold, and the vectorised form's dozen cost a SmolLM2 step 0.1 ms (issue 47)
FEW_ROWS = 8


class PagedKVCache:
    """Rows of slots in a `KVPool`: row ``b`` holds positions ``0 .. lengths[b] - 1`` at slots
    ``table[b, :lengths[b]]``. ``capacity`` bounds each row's length. The bookkeeping (table,
    lengths) lives on the CPU; the pool on the model's device."""

    def __init__(self, pool: KVPool, batch: int, capacity: int) -> None:
        if batch < 0 or capacity < 0:
            raise InvalidParameter("batch, capacity", (batch, capacity), "non-negative sizes")
        self.pool = pool
        self.slots = np.zeros((batch, capacity), dtype=np.int64)  # slot of each position
        self._n = np.zeros(batch, dtype=np.int64)  # lengths
        self._lengths: torch.Tensor | None = None  # device copy, rebuilt after a change
        self._table: torch.Tensor | None = None
        self._released = False
        # what a device copy of the table (`metaloom.models.engine.graphs`) checks to stay current:
        # this cache's identity, and a count of the writes it cannot follow (several positions
        # of a row at once); a one-token step it mirrors itself, and truncation needs nothing
        self.serial = next(_SERIALS)
        self.wide_writes = 0
        self.shift = np.zeros(batch, dtype=np.int64)  # positions dropped before each row's entries end
        self.sinks = np.zeros(batch, dtype=np.int64)  # leading entries attended at in-cache positions
        self.mass: np.ndarray | None = None  # [B, capacity] accumulated attention (H2O), once asked for

    # --- the KVCache protocol ---------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        """[B] long on the pool's device. A fresh tensor after every change: callers may keep one."""
        if self._lengths is None:
            self._lengths = torch.from_numpy(self._n.copy()).to(self.pool.device)
        return self._lengths

    def host_lengths(self) -> np.ndarray:
        """[B] int64 lengths on the host (a copy; no device transfer)."""
        return self._n.copy()

    def host_positions(self) -> np.ndarray:
        """[B] int64: the position each row's next token takes, its length plus the positions it
        dropped (equal to the lengths when nothing was dropped)."""
        return self._n + self.shift

    @property
    def drops(self) -> bool:
        """Whether any row has dropped positions (its entries are no longer its positions)."""
        return bool(self.shift.any())

    def evict(self, row: int, keep: np.ndarray, *, sinks: int = 0) -> int:
        """Keep only entries ``keep`` (ascending indices below the row's length) of row ``row``,
        moved to the front in order; the others let go of their slots. Their count is added to
        the row's ``shift``; ``sinks`` becomes the row's count of leading entries attended at
        in-cache positions. Returns how many entries were dropped."""
        keep = np.asarray(keep, dtype=np.int64)
        if not 0 <= sinks <= keep.size:
            raise InvalidParameter("sinks", sinks, f"in [0, {keep.size}] (the kept entries)")
        gone = self.keep_entries(row, keep)
        self.shift[row] += gone
        self.sinks[row] = sinks
        return gone

    def keep_entries(self, row: int, keep: np.ndarray) -> int:
        """Keep only entries ``keep`` (ascending, below the row's length) of row ``row``, moved to
        the front in order; the others let go of their slots (the slots themselves stay where they
        are). Positions are the caller's business: `evict` counts the dropped ones in ``shift``; a
        token-tree verify keeps the accepted path, whose positions follow on. Returns how many
        entries were dropped."""
        n = int(self._n[row]) if 0 <= row < self.batch else -1
        keep = np.asarray(keep, dtype=np.int64)
        if n < 0 or (keep.size and (int(keep[0]) < 0 or int(keep[-1]) >= n or bool((np.diff(keep) <= 0).any()))):
            raise InvalidParameter("keep", keep.tolist(), f"ascending entries of a row in [0, {self.batch}) below its length")
        gone = n - keep.size
        if gone:
            dropped = np.ones(n, dtype=bool)
            dropped[keep] = False
            self.pool.release(self.slots[row, :n][dropped])
            self.slots[row, :keep.size] = self.slots[row, keep]
            self.slots[row, keep.size:n] = SCRATCH
            if self.mass is not None:
                self.mass[row, :keep.size] = self.mass[row, keep]
                self.mass[row, keep.size:n] = 0.0
            self._n = self._n.copy()
            self._n[row] = keep.size
            self._lengths = None
            self.wide_writes += 1  # a device copy of the table cannot follow this
            if self.pool.device.type != "cpu":
                self._table = None
        return gone

    def attention_mass(self) -> np.ndarray:
        """[B, capacity] float64: what H2O accumulates per entry, made (zeros) on first use."""
        if self.mass is None or self.mass.shape != self.slots.shape:
            self.mass = np.zeros(self.slots.shape)
        return self.mass

    @property
    def capacity(self) -> int:
        return self.slots.shape[1]

    @property
    def batch(self) -> int:
        return len(self._n)

    def fork(self, rows: Sequence[int]) -> PagedKVCache:
        """A new cache whose row ``i`` shares row ``rows[i]``'s keys and values (no KV copy)."""
        index = np.asarray(list(rows), dtype=np.int64)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.batch):
            raise InvalidParameter("rows", list(rows), f"row indices in [0, {self.batch})")
        new = PagedKVCache(self.pool, len(index), self.capacity)
        new._n = self._n[index].copy()
        used = int(new._n.max()) if len(index) else 0
        new.slots[:, :used] = self.slots[index, :used]
        new.shift, new.sinks = self.shift[index].copy(), self.sinks[index].copy()
        if self.mass is not None:
            new.mass = self.mass[index].copy()
        self.pool.retain(new._held())
        return new

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        """Shorten each row to ``lengths[b]`` (<= its length); dropped positions let go of their slots."""
        # host lists where it can: a speculative step rolls back after every verify, right after a
        # forward, when each numpy or torch call starts with cold caches (tens of microseconds)
        values = lengths.tolist() if isinstance(lengths, torch.Tensor) else [int(n) for n in lengths]
        now = self._n.tolist()
        if len(values) != len(now) or any(not 0 <= n <= m for n, m in zip(values, now, strict=True)):
            raise InvalidParameter("lengths", values, f"{self.batch} values in [0, current lengths {now}]")
        new = np.asarray(values, dtype=np.int64)
        dropped = [self.slots[b, n:m] for b, (n, m) in enumerate(zip(values, now, strict=True)) if n < m]
        if dropped:
            self.pool.release(np.concatenate(dropped))
        if self.mass is not None:
            for b in range(self.batch):
                self.mass[b, new[b]:self._n[b]] = 0.0
        self._n = new.copy()
        self._lengths = None

    def join(self, other: PagedKVCache) -> PagedKVCache:
        """This cache's rows, then ``other``'s, in a new cache; both given caches are spent (their
        references move over, nothing is copied in the pool). Rows of another pool of the same
        shape are copied into this one first (a draft model's caches, made per start)."""
        if not isinstance(other, PagedKVCache):
            raise InvalidParameter("other", type(other).__name__, "a PagedKVCache")
        if other.pool is not self.pool:
            other = other.moved_to(self.pool)
        capacity = max(self.capacity, other.capacity)
        new = PagedKVCache(self.pool, self.batch + other.batch, capacity)
        new.slots[:self.batch, :self.capacity] = self.slots
        new.slots[self.batch:, :other.capacity] = other.slots
        new._n = np.concatenate([self._n, other._n])
        new.shift = np.concatenate([self.shift, other.shift])
        new.sinks = np.concatenate([self.sinks, other.sinks])
        if self.mass is not None or other.mass is not None:
            new.mass = np.zeros((new.batch, capacity))
            for at, part in ((0, self), (self.batch, other)):
                if part.mass is not None:
                    new.mass[at:at + part.batch, :part.capacity] = part.mass
        for spent in (self, other):
            spent._n = np.zeros(0, dtype=np.int64)
            spent.slots = np.zeros((0, 0), dtype=np.int64)
            spent._released = True
        return new

    def moved_to(self, pool: KVPool) -> PagedKVCache:
        """The same rows in ``pool`` (their keys and values copied; rows that shared a slot still
        share its copy). This cache is spent."""
        p = self.pool
        shape = (pool.layers, pool.kv_heads, pool.head_dim, pool.dtype, pool.compute_dtype)
        if shape != (p.layers, p.kv_heads, p.head_dim, p.dtype, p.compute_dtype):
            raise InvalidParameter("pool", shape, "a pool of the same shape, storage and compute dtype")
        held = self._held()
        old = np.unique(held)
        new = pool.allocate(len(old))
        src = torch.from_numpy(old).to(p.device)
        dst = torch.from_numpy(new).to(pool.device)
        # codes and scales copied as stored: a moved row reads exactly the keys it read before
        for to, come in zip(pool.tensors(), p.tensors(), strict=True):
            to[dst] = come[src].to(pool.device)
        # every reference a row held moves: one per occurrence, the allocation gave one per slot
        pool.retain(new[np.searchsorted(old, held)])
        pool.release(new)
        moved = PagedKVCache(pool, self.batch, self.capacity)
        moved._n = self._n.copy()
        moved.shift, moved.sinks = self.shift.copy(), self.sinks.copy()
        moved.mass = None if self.mass is None else self.mass.copy()
        for b in range(self.batch):
            n = int(self._n[b])
            moved.slots[b, :n] = new[np.searchsorted(old, self.slots[b, :n])]
        self.release()
        return moved

    def release(self) -> None:
        """Let go of every slot (idempotent). The cache is empty afterwards."""
        if self._released:
            return
        self._released = True
        held = self._held()
        self._n = np.zeros(self.batch, dtype=np.int64)
        self._lengths = None
        self.pool.release(held)

    def __del__(self) -> None:
        # a safety net for caches dropped without `release` (an exception mid-decode)
        with contextlib.suppress(Exception):  # interpreter shutdown, or __init__ failed
            self.release()

    # --- what the model's forward uses --------------------------------------------------
    def reserve(self, new_tokens: int) -> None:
        """Raise `CacheFull` if appending ``new_tokens`` to the longest row would pass capacity."""
        need = (int(self._n.max()) if self.batch else 0) + new_tokens
        if need > self.capacity:
            raise CacheFull(f"KV cache needs {need} positions but was allocated {self.capacity}")

    def prepare(self, valid: Sequence[int], width: int) -> torch.Tensor:
        """Slots for a forward of ``width`` positions per row, the first ``valid[b]`` of which
        row b keeps: fresh slots for those, the scratch slot for the padding. Records the kept
        ones in the table (the lengths advance in `advance`). Returns [B, width] long slots."""
        return torch.from_numpy(self.prepare_host(valid, width)).to(self.pool.device)

    def prepare_host(self, valid: Sequence[int], width: int, *, mirrored: bool = False) -> np.ndarray:
        """`prepare`, returning the slots [B, width] as a host array (no device copy).
        ``mirrored``: the caller writes these slots into its own device copy of the table (a
        static step, `metaloom.models.engine.graphs`), so the copy stays current."""
        self.reserve(width)
        keep = [int(v) for v in valid]
        fresh = self.pool.allocate(sum(keep))
        out = np.full((self.batch, width), SCRATCH, dtype=np.int64)
        self.wide_writes += width > 1 and not mirrored
        few = self.batch <= FEW_ROWS  # row by row in Python ints (FEW_ROWS says why)
        if width == 1 and not few:  # a decode step of many rows: one slot per kept row, vectorised
            out[np.flatnonzero(keep), 0] = fresh
        else:
            at = 0
            for b, k in enumerate(keep):
                out[b, :k] = fresh[at:at + k]
                at += k
        # the table gets every written position, padding included (as the scratch slot): a
        # kernel that writes at a row's next position must never find a stale slot there,
        # which may by now belong to another row
        if few:
            for b, n in enumerate(self._n.tolist()):
                self.slots[b, n:n + width] = out[b]
        else:
            for j in range(width):
                self.slots[np.arange(self.batch), self._n + j] = out[:, j]
        self._table = None if self.pool.device.type != "cpu" else self._table
        return out

    def advance(self, valid: torch.Tensor | Sequence[int]) -> None:
        add = valid.tolist() if isinstance(valid, torch.Tensor) else [int(v) for v in valid]  # no device wait on a CPU
        self._n = self._n + np.asarray(add, dtype=np.int64)
        self._lengths = None

    def table(self) -> torch.Tensor:
        """The slot table [B, capacity] as a contiguous long tensor on the pool's device;
        entries past a row's length are stale and must be masked. On the CPU it shares memory
        with the bookkeeping, so it is always current."""
        if self._table is None:
            self._table = torch.from_numpy(self.slots)
            if self.pool.device.type != "cpu":
                self._table = self._table.to(self.pool.device)
        return self._table

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [B, H_kv, T, D] at ``slots`` [B, T] (from `prepare`): quantised into an
        int8 pool, converted into a float pool of another dtype."""
        flat = slots.reshape(-1)
        kv_heads, dim = k.shape[1], k.shape[3]
        k = k.transpose(1, 2).reshape(-1, kv_heads, dim)  # [B T, H_kv, D]
        v = v.transpose(1, 2).reshape(-1, kv_heads, dim)
        pool = self.pool
        if pool.quantized:
            (kq, ks), (vq, vs) = quantize(k), quantize(v)
            pool.keys[layer][flat], pool.key_scales[layer][flat] = kq, ks
            pool.values[layer][flat], pool.value_scales[layer][flat] = vq, vs
            return
        pool.keys[layer][flat] = k.to(pool.dtype)  # a no-op for a pool of the compute dtype
        pool.values[layer][flat] = v.to(pool.dtype)

    def run_start(self, length: int) -> int | None:
        """The first slot when this is a single row whose positions ``0 .. length - 1`` sit in one
        ascending run of slots (batch-1 decoding, a speculative verify), else None. Asked once
        per forward: `gather` then reads a view of the pool instead of copying (a float pool of
        the compute dtype; any other is converted on read, so there is no view to take)."""
        pool = self.pool
        if self.batch != 1 or length <= 0 or pool.dtype != pool.compute_dtype:
            return None
        run = self.slots[0, :length]
        first = int(run[0])
        if int(run[-1]) - first == length - 1 and bool((np.diff(run) == 1).all()):
            return first
        return None

    def gather(self, layer: int, length: int, run: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. length - 1`` of every row, [B, H_kv, length, D]
        (positions past a row's length hold stale data and must be masked): a copy, or with
        ``run`` (from `run_start`) a view of the pool, read in place. In the pool's
        ``compute_dtype``: an int8 pool's keys dequantised, another float dtype's converted."""
        pool = self.pool
        if run is not None:
            k = pool.keys[layer][run:run + length]  # [L, H, D]
            v = pool.values[layer][run:run + length]
            return k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        table = self.table()
        flat = table[:, :length].reshape(-1)

        def rows(t: torch.Tensor) -> torch.Tensor:  # t [slots, ...] -> [B, length, ...]
            # index_select, not t[index]: advanced indexing splits even a few hundred rows over
            # OpenMP threads, and on 2 busy cores that cost 6-12 ms a call against 15 us (measured)
            return t.index_select(0, flat).view(table.shape[0], length, *t.shape[1:])

        k, v = rows(pool.keys[layer]), rows(pool.values[layer])  # [B, L, H, D]
        if pool.quantized:
            k = dequantize(k, rows(pool.key_scales[layer]), pool.compute_dtype)
            v = dequantize(v, rows(pool.value_scales[layer]), pool.compute_dtype)
        elif pool.dtype != pool.compute_dtype:
            k, v = k.to(pool.compute_dtype), v.to(pool.compute_dtype)
        return k.transpose(1, 2), v.transpose(1, 2)

    # --- rows as slot lists (the prefix cache) ---------------------------------------------
    def row_slots(self, row: int, start: int, end: int) -> np.ndarray:
        """The slots of row ``row``'s positions ``start .. end - 1`` (a copy of the ids). A row that
        dropped positions (`evict`) has none to give: its entries are not its positions."""
        if not 0 <= row < self.batch or not 0 <= start <= end <= int(self._n[row]):
            raise InvalidParameter("span", (row, start, end), f"a row in [0, {self.batch}) and 0 <= start <= end <= its length")
        if self.shift[row]:
            raise InvalidParameter("row", row, "a row that dropped no positions (its entries are not its positions)")
        return self.slots[row, start:end].copy()

    def append_slots(self, row: int, slots: np.ndarray) -> None:
        """Append positions held at ``slots`` (already in this pool, e.g. a cached prefix) to
        row ``row``, taking a reference to each."""
        if not 0 <= row < self.batch:
            raise InvalidParameter("row", row, f"a row in [0, {self.batch})")
        if self.shift[row]:
            raise InvalidParameter("row", row, "a row that dropped no positions (cached positions follow position 0..)")
        start, n = int(self._n[row]), len(slots)
        if start + n > self.capacity:
            raise CacheFull(f"KV cache row needs {start + n} positions but was allocated {self.capacity}")
        self.pool.retain(slots)
        self.slots[row, start:start + n] = slots
        self.wide_writes += 1
        self._n = self._n.copy()
        self._n[row] += n
        self._lengths = None
        if self.pool.device.type != "cpu":
            self._table = None

    def _held(self) -> np.ndarray:
        if not self.batch:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.slots[b, :self._n[b]] for b in range(self.batch)])
