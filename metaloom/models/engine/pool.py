"""The KV pool: every layer's keys and values in token slots, [slots, H_kv, D] per layer, with a
reference count per slot. A row of a cache (`metaloom.models.engine.cache.PagedKVCache`) is the
list of its positions' slots; forking a row retains its slots, and a slot is written once, by
the row that allocated it, before anyone can share it (the module doc of
`metaloom.models.engine.cache` says why slots).

Storage: a pool stores keys and values in its ``dtype`` and hands them out in its
``compute_dtype`` (the model's). They differ with ``--kv-dtype``: bfloat16 storage under a
float32 model converts on write and read; int8 storage (`metaloom.models.engine.kv_int8`) keeps
a float32 scale per slot and kv head beside the codes, [slots, H_kv] per layer, quantising on
write and dequantising on read.

Slot 0 is a scratch slot owned by the pool: positions a forward computes but does not keep
(right padding, rows that already finished) are written there and never read.

Reference counts free a slot when the last row (or prefix-cache entry) holding it lets go:
`PagedKVCache.release`, `truncate`, `evict`, and garbage collection of a cache nobody released.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from metaloom.errors import CacheFull, InvalidParameter

SCRATCH = 0  # the slot padding writes go to
SMALL_RELEASE = 64  # `KVPool.release` of at most this many slots walks them as Python ints
KV_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # --kv-dtype's types


def storage_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The pool dtype ``--kv-dtype`` asks for under a model computing in ``compute`` (``auto``:
    ``compute`` itself)."""
    if kv_dtype == "auto":
        return compute
    if kv_dtype not in KV_STORAGE:
        raise InvalidParameter("kv_dtype", kv_dtype, f"one of {['auto', *KV_STORAGE]}")
    return KV_STORAGE[kv_dtype]


class KVPool:
    """Keys and values for ``slots`` token slots of every layer, [slots, H_kv, D] each, with a
    reference count per slot. Grows (doubling, copying once) when a request needs more free
    slots than it has; ``max_slots`` bounds it (`CacheFull` beyond). Thread-safe.

    ``dtype``: what the tensors store, a float dtype or torch.int8 (then ``key_scales`` and
    ``value_scales`` hold a float32 scale per slot and kv head, [slots, H_kv] per layer; empty
    lists for a float pool). ``compute_dtype``: what `PagedKVCache.gather` returns and `write`
    takes (default: ``dtype``, float32 for an int8 pool)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", slots: int = 256, max_slots: int | None = None, *,
                 compute_dtype: torch.dtype | None = None) -> None:
        if slots < 2:
            raise InvalidParameter("slots", slots, ">= 2 (slot 0 is scratch)")
        if not (dtype.is_floating_point or dtype == torch.int8):
            raise InvalidParameter("dtype", dtype, "a float dtype or torch.int8")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise InvalidParameter("compute_dtype", compute_dtype, "a float dtype")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.compute_dtype = compute_dtype or (dtype if dtype.is_floating_point else torch.float32)
        self.max_slots = max_slots
        shape = (slots, kv_heads, head_dim)
        try:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            scales = layers if self.quantized else 0
            self.key_scales = [torch.zeros(shape[:2], dtype=torch.float32, device=device) for _ in range(scales)]
            self.value_scales = [torch.zeros(shape[:2], dtype=torch.float32, device=device) for _ in range(scales)]
        except torch.OutOfMemoryError as exc:
            raise CacheFull(f"a KV pool of {slots} slots ({slots * self.bytes_per_slot / 2**30:.2f} GiB) does not fit "
                            f"on {self.device}: out of memory") from exc
        self.refs = np.zeros(slots, dtype=np.int64)
        self.refs[SCRATCH] = 1  # never freed, never allocated
        self._free = np.arange(slots - 1, 0, -1, dtype=np.int64)  # a stack: pop from the end
        self._nfree = slots - 1
        self.lock = threading.RLock()

    @property
    def slots(self) -> int:
        return len(self.refs)

    @property
    def used_slots(self) -> int:
        """Slots holding a live key/value (referenced by some row or prefix entry)."""
        return self.slots - 1 - self._nfree

    @property
    def quantized(self) -> bool:
        """int8 codes with per-slot scales (`metaloom.models.engine.kv_int8`)."""
        return self.dtype == torch.int8

    @property
    def bytes_per_slot(self) -> int:
        """A token's keys and values over every layer, the int8 pool's float32 scales included."""
        element = torch.empty((), dtype=self.dtype).element_size()
        scales = 2 * self.layers * self.kv_heads * 4 if self.quantized else 0
        return 2 * self.layers * self.kv_heads * self.head_dim * element + scales

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool stores (keys, values, then any scales), for memory accounting."""
        return [*self.keys, *self.values, *self.key_scales, *self.value_scales]

    @property
    def used_bytes(self) -> int:
        return self.used_slots * self.bytes_per_slot

    def allocate(self, n: int) -> np.ndarray:
        """``n`` fresh slots, each with one reference (the caller's)."""
        with self.lock:
            if n > self._nfree:
                self._grow(n - self._nfree)
            out = self._free[self._nfree - n:self._nfree][::-1].copy()
            self._nfree -= n
            self.refs[out] = 1
            return out

    def retain(self, slots: np.ndarray) -> None:
        """One more reference to each of ``slots`` (repeats count repeatedly)."""
        if slots.size == 0:
            return
        with self.lock:
            if slots.size > 4096:
                self.refs += np.bincount(slots, minlength=len(self.refs))
            else:
                np.add.at(self.refs, slots, 1)

    def release(self, slots: np.ndarray) -> None:
        """One reference fewer to each of ``slots``; slots left with none become free."""
        if slots.size == 0:
            return
        with self.lock:
            if slots.size <= SMALL_RELEASE:  # a rejected draft's few slots: Python ints, no numpy calls
                ids = slots.tolist()
                refs = self.refs
                for i in ids:
                    refs[i] -= 1
                left = [int(refs[i]) for i in ids]
                if min(left) < 0:  # pragma: no cover - a bookkeeping bug
                    raise RuntimeError("KV pool slot released more often than retained")
                gone = np.asarray(sorted({i for i, n in zip(ids, left, strict=True) if n == 0}), dtype=np.int64)
            else:
                if slots.size > 4096:
                    self.refs -= np.bincount(slots, minlength=len(self.refs))
                else:
                    np.subtract.at(self.refs, slots, 1)
                if bool((self.refs[slots] < 0).any()):  # pragma: no cover - a bookkeeping bug
                    raise RuntimeError("KV pool slot released more often than retained")
                gone = np.unique(slots[self.refs[slots] == 0])
            # pushed highest first, so the lowest is taken first: a row rolled back (a rejected
            # draft) and extended again gets the same ascending run of slots back, and its keys
            # stay one contiguous block that attention can read in place (`PagedKVCache.gather`)
            self._free[self._nfree:self._nfree + gone.size] = gone[::-1]
            self._nfree += gone.size

    def compact(self, slots: int) -> np.ndarray | None:
        """Shrink the pool to ``slots`` slots, moving every live slot down to the lowest ids
        (in order); returns the map from old slot ids to new ones (-1: a free slot), or None when
        the live slots do not fit. Only valid while nothing but the caller (who remaps its own
        references with the map) holds slot ids: the server does it when its loop is idle."""
        with self.lock:
            live = np.flatnonzero(self.refs[1:] > 0) + 1
            if len(live) + 1 > slots or slots >= self.slots:
                return None
            mapping = np.full(self.slots, -1, dtype=np.int64)
            mapping[SCRATCH] = SCRATCH
            mapping[live] = np.arange(1, len(live) + 1, dtype=np.int64)
            index = torch.as_tensor(live, dtype=torch.long, device=self.device)
            for ts in (self.keys, self.values, self.key_scales, self.value_scales):
                for i, t in enumerate(ts):
                    small = torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    small[1:len(live) + 1] = t[index]
                    ts[i] = small  # the same lists: holders of pool.keys see the new tensors
            refs = np.zeros(slots, dtype=np.int64)
            refs[SCRATCH] = 1
            refs[1:len(live) + 1] = self.refs[live]
            self.refs = refs
            self._free = np.arange(slots - 1, len(live), -1, dtype=np.int64)
            self._nfree = len(self._free)
            return mapping

    def _grow(self, extra: int) -> None:
        old = self.slots
        new = max(2 * old, old + extra)
        if self.max_slots is not None and new > self.max_slots:
            new = self.max_slots
            if new - old < extra:
                raise CacheFull(f"KV pool needs {old + extra - self._nfree} slots in use but is capped at {self.max_slots}")
        lists = (self.keys, self.values, self.key_scales, self.value_scales)
        try:
            grown = [[torch.zeros((new, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in ts] for ts in lists]
        except torch.OutOfMemoryError as exc:  # a GPU too small for the pool asked of it
            raise CacheFull(f"KV pool cannot grow from {old} to {new} slots ({new * self.bytes_per_slot / 2**30:.2f} GiB) "
                            f"on {self.device}: out of memory") from exc
        for ts, gs in zip(lists, grown, strict=True):
            for g, t in zip(gs, ts, strict=True):
                g[:old] = t
            ts[:] = gs  # the same lists: holders of pool.keys (or its scales) see the new tensors
        self.refs = np.concatenate([self.refs, np.zeros(new - old, dtype=np.int64)])
        # the free stack pops from its end: the new slots go below the old free ones, so low
        # slot ids are reused first
        added = np.arange(new - 1, old - 1, -1, dtype=np.int64)
        stack = np.empty(new, dtype=np.int64)
        stack[:len(added)] = added
        stack[len(added):len(added) + self._nfree] = self._free[:self._nfree]
        self._free = stack
        self._nfree += len(added)
