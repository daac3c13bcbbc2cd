"""The KV pool's reference counts (`metaloom.models.engine.pool.KVPool`): a release of a few
slots walks them as Python ints, a larger one as arrays; both must leave the same counts and
the same free list, and a slot released more often than it was held is a bookkeeping error."""

from __future__ import annotations

import pytest
import torch

from metaloom.models.engine import pool as pool_module
from metaloom.models.engine.pool import KVPool


def _run() -> tuple[list[int], list[int], list[int]]:
    """Allocate 10 slots, hold three of them more, release a mix with repeats; -> (the counts of
    the 10, the free list's top 4, the next 3 slots allocated)."""
    p = KVPool(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, slots=64)
    held = p.allocate(10)
    p.retain(held[[2, 3, 3]])  # slot 2 held twice, slot 3 three times
    p.release(held[[5, 2, 3, 7, 3, 6]])  # 5, 6, 7 let go; 2 and 3 still held (once each)
    top = p._free[p._nfree - 4:p._nfree].tolist()
    return p.refs[held].tolist(), top, p.allocate(3).tolist()


def test_a_release_of_a_few_slots_and_of_many_leave_the_same_counts_and_free_list(monkeypatch):
    small = _run()
    refs, top, again = small
    assert refs == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    # the freed slots come back lowest first, in one ascending run (a rolled-back row's keys
    # stay contiguous when it grows again)
    base = again[0]
    assert again == [base, base + 1, base + 2] and top[-3:] == [base + 2, base + 1, base]
    monkeypatch.setattr(pool_module, "SMALL_RELEASE", 0)  # every release through the arrays
    assert _run() == small


@pytest.mark.parametrize("small", [pool_module.SMALL_RELEASE, 0])
def test_releasing_a_slot_more_often_than_it_was_held_is_an_error(small, monkeypatch):
    monkeypatch.setattr(pool_module, "SMALL_RELEASE", small)
    p = KVPool(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, slots=64)
    held = p.allocate(2)
    with pytest.raises(RuntimeError, match="released more often"):
        p.release(held[[0, 0]])


@pytest.mark.parametrize("width", [1, 3])
def test_a_few_rows_prepare_the_same_slots_and_table_as_many_rows_do(width, monkeypatch):
    from metaloom.models.engine import cache as cache_module
    from metaloom.models.engine.cache import PagedKVCache

    def run() -> tuple[list[list[int]], list[list[int]], list[int]]:
        p = KVPool(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, slots=64)
        c = PagedKVCache(p, 3, 16)
        c.prepare_host([2, 0, 1], 2)  # rows of different lengths first
        c.advance([2, 0, 1])
        out = c.prepare_host([width, 0, 1], width)  # row 1 keeps nothing: the scratch slot
        c.advance(torch.tensor([width, 0, 1]))
        return out.tolist(), c.slots[:, :6].tolist(), c.host_lengths().tolist()

    few = run()
    out, table, lengths = few
    assert lengths == [2 + width, 0, 2] and out[1] == [0] * width
    assert out[0] == list(range(out[0][0], out[0][0] + width))  # a row's new slots: one ascending run
    assert table[0][2:2 + width] == out[0] and table[1][:width] == [0] * width
    monkeypatch.setattr(cache_module, "FEW_ROWS", 0)  # the vectorised form
    assert run() == few
