"""Which keys the rows of a decode step share in the KV pool: the input of shared-prefix attention.

Hydragen (Juravsky et al. 2024, "Hydragen: High-Throughput LLM Inference with Shared
Prefixes") splits each row's attention at the end of the prefix it shares with other rows: the
prefix part is computed for every sharing row's queries at once (one pass over the prefix's
keys and values for all of them, instead of one pass per row), the rest per row, and the parts
are merged exactly by their log-sum-exp (§3). Sharing nests — a few-shot prompt shared by all
rows, a partial solution shared by a subtree of a search — so the split is a tree.

Here sharing is read off the pool's slot tables (`metaloom.models.engine.cache`): rows that hold
the same slot at a position share that key, and since a slot is written once, by the row that
allocated it, rows holding the same slot at position ``p`` also agree on every position before
``p`` that they hold the same slots for. `find_sharing` walks the table from position 0, splits
the rows wherever their slots part, and returns the spans of positions each group of two or
more rows shares, and for each row where its own (private) positions start. Every row's
attention covers positions ``0 .. length`` (its new token included, which is always private) as
its spans in order, then its private part: contiguous and disjoint, so merging the parts is the
row's full softmax.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True, eq=False)
class Sharing:
    """Spans of positions shared by groups of rows, and each row's private start.

    Span ``s`` covers positions ``lo[s] .. hi[s] - 1`` of the rows ``rows[ptr[s]:ptr[s + 1]]``
    (two or more), which hold the same slots there. A pair is one (span, row) entry of ``rows``:
    row ``r``'s pairs are ``pairs[row_ptr[r]:row_ptr[r + 1]]`` (indices into ``rows``), its spans
    in order of position, covering ``0 .. private_from[r] - 1``. All arrays int64."""

    lo: np.ndarray
    hi: np.ndarray
    ptr: np.ndarray
    rows: np.ndarray
    private_from: np.ndarray
    row_ptr: np.ndarray
    pairs: np.ndarray

    @property
    def spans(self) -> int:
        return len(self.lo)

    def saved_reads(self) -> int:
        """Key (and value) reads a step saves per layer and kv head: each span is read once for
        its rows, not once per row."""
        sizes = np.diff(self.ptr)
        return int(((sizes - 1) * (self.hi - self.lo)).sum())

    @cached_property
    def desc(self) -> SharingDesc:
        """The C view (`fused.c`'s ``sharing_desc``), made once: a step passes it to every layer.
        It points into these arrays, so keep this object alive while the view is used."""
        def p(a: np.ndarray) -> int:
            return int(a.ctypes.data)

        return SharingDesc(self.spans, p(self.lo), p(self.hi), p(self.ptr), p(self.rows), len(self.rows),
                           p(self.private_from), p(self.row_ptr), p(self.pairs))


class SharingDesc(ctypes.Structure):
    _fields_ = [("spans", ctypes.c_int64), ("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p),
                ("ptr", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("npairs", ctypes.c_int64),
                ("private_from", ctypes.c_void_p), ("row_ptr", ctypes.c_void_p), ("pairs", ctypes.c_void_p)]


# a shared span is cut into pieces of this many positions: the kernel's work for a span is one
# task per piece (and kv head, and 64 rows), so a long prompt shared by a few rows still spreads
# over threads, and each task's key block serves every row of the piece
PIECE = 512


def find_sharing(slots: np.ndarray, lengths: np.ndarray, piece: int = PIECE) -> Sharing | None:
    """The sharing tree of rows with slot table ``slots`` [R, capacity] and ``lengths`` [R]
    cached positions each (a decode step's new position, ``lengths[r]``, is never shared), or
    None when no two rows share a position. Spans longer than ``piece`` come as consecutive
    spans of the same rows."""
    n_rows = len(lengths)
    if n_rows < 2:
        return None
    lengths = np.asarray(lengths, dtype=np.int64)
    private_from = np.zeros(n_rows, dtype=np.int64)
    spans: list[tuple[int, int, np.ndarray]] = []
    todo: list[tuple[np.ndarray, int]] = [(np.arange(n_rows, dtype=np.int64), 0)]
    while todo:
        rows, start = todo.pop()
        if len(rows) < 2:
            private_from[rows] = start
            continue
        end = int(lengths[rows].min())
        block = slots[rows, start:end]
        same = (block == block[0]).all(axis=0)
        shared = int(np.argmin(same)) if not bool(same.all()) else end - start
        at = start + shared
        spans.extend((lo, min(lo + piece, at), rows) for lo in range(start, at, piece))
        # each step either emits a span, finishes rows, or splits the group in two or more,
        # so the walk ends
        done = lengths[rows] == at
        private_from[rows[done]] = at
        rest = rows[~done]
        if len(rest):
            keys = slots[rest, at]
            order = np.argsort(keys, kind="stable")
            cuts = np.flatnonzero(np.diff(keys[order])) + 1
            todo.extend((group, at) for group in reversed(np.split(rest[order], cuts)))
    if not spans:
        return None
    spans.sort(key=lambda s: (s[0], int(s[2][0])))  # by position: each row's spans in order
    lo = np.array([s[0] for s in spans], dtype=np.int64)
    hi = np.array([s[1] for s in spans], dtype=np.int64)
    ptr = np.zeros(len(spans) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(s[2]) for s in spans])
    flat = np.concatenate([s[2] for s in spans]).astype(np.int64)
    pairs = np.argsort(flat, kind="stable").astype(np.int64)  # by row, then by span (position)
    row_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    row_ptr[1:] = np.cumsum(np.bincount(flat, minlength=n_rows))
    return Sharing(lo, hi, ptr, flat, private_from, row_ptr, pairs)
