"""What holds the server's memory, and how large its KV pool may grow (issue 30).

Accounting (`/metrics`, ``metaloom_memory_bytes{part=...}``): ``weights`` is every plain tensor
the model object holds (dense or quantised weights, rope tables), each storage counted once
however many views share it; ``weights_packed`` the copies laid out for MKL and oneDNN (dense
float32 weights keep two besides the plain one, `metaloom.models.kernels.packed`: SmolLM2 on
``--weights dense`` holds 0.54 GB plain and 2.26 GB packed as PyTorch reports the opaque sizes,
2.3 GB resident in all, where the native GGUF weights are 0.10 GB and 0.44 GB resident);
``kv_pool`` the keys and values the engine's `KVPool` has allocated
(it grows by doubling and keeps its size), ``kv_pool_used`` the slots live rows and the prefix
cache hold, ``prefix_cache`` the slots the prefix cache keeps alive (part of ``kv_pool_used``),
``kv_pool_limit`` the most the pool may grow to, ``process_rss`` the resident set (VmRSS).
What RSS holds beyond the parts is the Python and PyTorch runtime (libraries, allocator arenas).

Sizing (`kv_pool_limit`): the pool never needs more than ``max_rows`` rows of a full context
window, and must leave the machine room: at most ``fraction`` of the memory available when the
server starts. The prefix cache keeps at most half of that, so running rows always have room.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from metaloom.generator.local import LocalGenerator

log = logging.getLogger("metaloom.server")
DEFAULT_FRACTION = 0.5  # of MemAvailable at start, for the KV pool


def storage_bytes(obj: Any, max_depth: int = 8) -> int:
    """Bytes of every tensor (and numpy array) reachable from ``obj`` through dataclass fields,
    attributes, lists, tuples and dicts, each underlying storage counted once."""
    return sum(storage_parts(obj, max_depth).values())


def storage_parts(obj: Any, max_depth: int = 8) -> dict[str, int]:
    """`storage_bytes` in two parts: ``plain`` (tensors with a storage, numpy arrays) and
    ``packed`` (opaque tensors: oneDNN's and MKL's packed layouts, counted by their elements)."""
    seen_objects: set[int] = set()
    storages: dict[Any, int] = {}

    def walk(o: Any, depth: int) -> None:
        if depth > max_depth or id(o) in seen_objects:
            return
        seen_objects.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.is_mkldnn:  # oneDNN's packed weights: an opaque tensor, no storage
                storages[("opaque", id(o))] = o.numel() * o.element_size()
                return
            s = o.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(o, np.ndarray):
            base = o if o.base is None or not isinstance(o.base, np.ndarray) else o.base
            storages[base.__array_interface__["data"][0]] = max(storages.get(base.__array_interface__["data"][0], 0),
                                                               base.nbytes)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name, None), depth + 1)
        elif hasattr(o, "__dict__") and not isinstance(o, type) and not callable(o):
            for v in vars(o).values():
                walk(v, depth + 1)

    walk(obj, 0)
    packed = sum(v for k, v in storages.items() if isinstance(k, tuple))
    return {"plain": sum(storages.values()) - packed, "packed": packed}


def kv_pool_bytes(pool: Any) -> int:
    """Bytes the pool's key and value tensors (and an int8 pool's scales) hold now."""
    return sum(t.untyped_storage().nbytes() for t in pool.tensors())


def kv_pool_limit(bytes_per_slot: int, max_rows: int, context: int, available_bytes: int,
                  fraction: float = DEFAULT_FRACTION) -> int:
    """Slots the KV pool may grow to: ``min(max_rows * context + 1, fraction * available_bytes
    // bytes_per_slot)`` (slot 0 is scratch), and at least 2."""
    if bytes_per_slot <= 0 or max_rows < 1 or context < 1 or available_bytes < 0 or not 0 < fraction <= 1:
        raise ValueError("kv_pool_limit: positive slot size, rows and context, a fraction in (0, 1]")
    return max(2, min(max_rows * context + 1, int(fraction * available_bytes) // bytes_per_slot))


def prefix_budget(requested_bytes: int, pool_limit_bytes: int) -> int:
    """The prefix cache's budget: what was asked, at most half the pool's limit."""
    return max(0, min(requested_bytes, pool_limit_bytes // 2))


def meminfo(field: str = "MemAvailable", path: str = "/proc/meminfo") -> int | None:
    """A /proc/meminfo figure in bytes (None where there is none: not Linux)."""
    return _kb_field(path, field)


def process_rss(path: str = "/proc/self/status") -> int | None:
    """This process's resident set (VmRSS) in bytes, or None off Linux."""
    return _kb_field(path, "VmRSS")


def _kb_field(path: str, field: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except OSError:
        return None
    return None


def trim() -> None:
    """Hand the allocator's freed memory back to the system (glibc's malloc_trim; a no-op
    elsewhere). Called when the decode loop goes idle: activations of a large batch otherwise stay
    resident."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def shrink_pool(generator: LocalGenerator, floor: int = 256) -> int | None:
    """Give back the KV pool a burst grew: when nothing but the prefix cache holds slots (the
    loop is idle), compact the pool to twice what is live (at least ``floor`` slots) if that is
    at most half its size. Returns the new size, or None when it stays as it is."""
    pool = generator.pool
    if pool is None:
        return None
    cache = generator.prefix_cache
    with pool.lock:
        held = int(pool.refs[1:].sum())
        if held != (cache.cached_tokens if cache is not None else 0):  # a row still holds slots: not idle
            return None
        target = max(floor, 2 * pool.used_slots + 2)
        if 2 * target > pool.slots:
            return None
        mapping = pool.compact(target)
        if mapping is None:
            return None
        if cache is not None:
            cache.remap(mapping)
    log.info("KV pool given back: %d slots now (%.0f MiB)", pool.slots, pool.slots * pool.bytes_per_slot / 2**20)
    return pool.slots


def size_pools(generator: LocalGenerator, max_rows: int, available: int | None = None, cap_bytes: int | None = None) -> None:
    """Bound the engine's KV pool and prefix cache by `metaloom.server.memory.kv_pool_limit`
    (``max_rows`` full context windows, half the memory available now; at most ``cap_bytes``,
    ``metaloom serve --kv-pool-mb``) and `prefix_budget`."""
    pool = generator.pool
    available = meminfo() if available is None else available
    if pool is None or (available is None and cap_bytes is None):
        return
    limit = max_rows * generator.model.max_context + 1
    if available is not None:
        limit = kv_pool_limit(pool.bytes_per_slot, max_rows, generator.model.max_context, available)
    if cap_bytes is not None:
        limit = max(2, min(limit, cap_bytes // pool.bytes_per_slot))
    pool.max_slots = limit if pool.max_slots is None else min(pool.max_slots, limit)
    if generator.prefix_cache is not None:
        cache = generator.prefix_cache
        cache.budget_bytes = prefix_budget(cache.budget_bytes, pool.max_slots * pool.bytes_per_slot)
    log.info("KV pool: at most %d slots (%.0f MiB; %d B a token); prefix cache at most %.0f MiB", pool.max_slots,
             pool.max_slots * pool.bytes_per_slot / 2**20, pool.bytes_per_slot,
             (generator.prefix_cache.budget_bytes if generator.prefix_cache is not None else 0) / 2**20)


def memory_parts(generator: LocalGenerator, weights: Mapping[str, int]) -> dict[str, int]:
    """``metaloom_memory_bytes`` by part (`metaloom.server.memory` says what each holds)."""
    parts = {"weights": weights["plain"], "weights_packed": weights["packed"]}
    pool = generator.pool
    if pool is not None:
        with pool.lock:
            parts["kv_pool"] = kv_pool_bytes(pool)
            parts["kv_pool_used"] = pool.used_bytes
            parts["kv_pool_limit"] = (pool.max_slots or pool.slots) * pool.bytes_per_slot
    if generator.prefix_cache is not None:
        parts["prefix_cache"] = generator.prefix_cache.used_bytes
    rss = process_rss()
    if rss is not None:
        parts["process_rss"] = rss
    return parts
