"""Shared-prefix attention (Hydragen): the sharing tree read off slot tables
(metaloom.models.engine.sharing) on hand-made tables, the fused kernel's shared path against its
per-row path on random data (many rows, nested prefixes, both thread counts), and a model's
decode steps over forked rows with it on against off, rows admitted mid-flight included. Kernel
tests run once per instruction-set path this CPU runs (the ``path_kernels`` fixture)."""

import numpy as np
import pytest
import torch

from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.rope import rope_tables
from metaloom.models.engine.sharing import find_sharing
from metaloom.models.kernels.fused import kernels
from tests.test_fused import _as, _tiny

CPU = torch.device("cpu")
KERNELS = kernels().kernels
KERNELS_OF = kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no fused kernels here: {kernels().reason}")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spans(sharing):
    """[(lo, hi, rows)] in the order the kernel gets them."""
    return [(int(sharing.lo[s]), int(sharing.hi[s]), sorted(sharing.rows[sharing.ptr[s]:sharing.ptr[s + 1]].tolist()))
            for s in range(sharing.spans)]


def test_find_sharing_reads_a_nested_tree_off_the_slot_table():
    # rows 0-3 fork one 5-token prompt (slots 10..14); rows 0 and 1 then share 2 more tokens
    # (a partial solution of a subtree) and part; rows 2 and 3 part right after the prompt;
    # row 4 is another request
    table = np.zeros((5, 12), dtype=np.int64)
    table[:4, :5] = np.arange(10, 15)
    table[0:2, 5:7] = [20, 21]
    table[0, 7:9] = [30, 31]
    table[1, 7:10] = [40, 41, 42]
    table[2, 5:8] = [50, 51, 52]
    table[3, 5:6] = [60]
    table[4, :6] = np.arange(70, 76)
    lengths = np.array([9, 10, 8, 6, 6])
    sharing = find_sharing(table, lengths)
    assert sharing is not None
    assert _spans(sharing) == [(0, 5, [0, 1, 2, 3]), (5, 7, [0, 1])]
    assert sharing.private_from.tolist() == [7, 7, 5, 5, 0]
    # each row's pairs, in order of position, index its entries in rows
    for r, expected in enumerate([[0, 1], [0, 1], [0], [0], []]):
        ks = sharing.pairs[sharing.row_ptr[r]:sharing.row_ptr[r + 1]]
        assert assert_spans_of(sharing, ks) == expected
        assert all(int(sharing.rows[k]) == r for k in ks)
    assert sharing.saved_reads() == 3 * 5 + 1 * 2


def assert_spans_of(sharing, ks):
    return [int(np.searchsorted(sharing.ptr, k, side="right") - 1) for k in ks]


def test_find_sharing_stops_a_span_at_the_shortest_row_and_ignores_unshared_rows():
    table = np.zeros((3, 10), dtype=np.int64)
    table[:, :6] = np.arange(1, 7)
    table[2, :6] = np.arange(101, 107)  # shares nothing
    table[0, 6:8] = [7, 8]
    lengths = np.array([8, 4, 6])  # row 1 was truncated (a rejected draft) inside the prompt
    sharing = find_sharing(table, lengths)
    assert _spans(sharing) == [(0, 4, [0, 1])]
    assert sharing.private_from.tolist() == [4, 4, 0]
    assert find_sharing(table[2:], lengths[2:]) is None  # one row
    assert find_sharing(table[[0, 2]], lengths[[0, 2]]) is None  # nothing shared


def _attend(qkv, cos, sin, lengths, table, keys, values, heads, threads, sharing, dtype):
    out = torch.empty(len(lengths), heads * keys.shape[2], dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, None, threads, sharing)
    return out


@needs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 128), (14, 2, 64), (2, 2, 96)])
def test_shared_attention_equals_per_row_attention(heads, kv_heads, dim, threads, dtype):
    # 37 rows (more than one 16-row span task): a 70-token prompt shared by rows 0..29, a
    # 13-token continuation shared by rows 0..11 and another of 40 by rows 12..20 (nested),
    # rows 30..36 private; lengths of every kind
    rows, cap, slots = 37, 160, 4000
    gen = np.random.default_rng(0)
    free = gen.permutation(np.arange(1, slots))
    table = np.zeros((rows, cap), dtype=np.int64)
    lengths = gen.integers(115, 140, size=rows)  # past every shared span
    lengths[30:] = gen.integers(1, 60, size=7)
    at = 0

    def take(n):
        nonlocal at
        at += n
        return free[at - n:at]

    table[:30, :70] = take(70)
    table[:12, 70:83] = take(13)
    table[12:21, 70:110] = take(40)
    for r in range(rows):
        start = 0 if r >= 30 else (83 if r < 12 else 110 if r < 21 else 70)
        table[r, start:lengths[r] + 1] = take(lengths[r] + 1 - start)  # own positions and the new one
    sharing = find_sharing(table, lengths)
    assert _spans(sharing) == [(0, 70, list(range(30))), (70, 83, list(range(12))), (70, 110, list(range(12, 21)))]
    cos, sin = rope_tables(dim, 10000.0, None, 256, dtype, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(1)).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=_g(2)).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=_g(3)).to(dtype)
    tl, tt = torch.from_numpy(lengths), torch.from_numpy(table)
    k1, v1, k2, v2 = keys.clone(), values.clone(), keys.clone(), values.clone()
    per_row = _attend(qkv, cos, sin, tl, tt, k1, v1, heads, threads, None, dtype)
    shared = _attend(qkv, cos, sin, tl, tt, k2, v2, heads, threads, sharing, dtype)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)  # the same new keys and values, in the same slots
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]  # summation order; one bfloat16 rounding
    assert (per_row.float() - shared.float()).abs().max().item() <= tol


@needs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_steps_with_shared_prefix_attention_equal_steps_without(dtype):
    """Forked rows decode with sharing on and off: logits to float rounding, greedy tokens equal;
    a second request's forks join mid-flight (another prompt: a second tree)."""
    base = _as(_tiny(), dtype).with_fused(KERNELS)
    on, off = (base.with_options(EngineOptions(shared_prefix_attention=m)) for m in ("on", "off"))
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]
    prompts = [torch.randint(0, 103, (1, 20), generator=_g(4)), torch.randint(0, 103, (1, 11), generator=_g(5))]
    caches, tokens = [], []
    for model in (on, off):
        root = model.new_cache(1, 60)
        out = model.forward(prompts[0], root, last_only=True)
        cache = root.fork([0] * 5)
        root.release()
        caches.append(cache)
        tokens.append(out[:, -1].argmax(-1).expand(5).clone())
    seen = []
    for step in range(12):
        if step == 4:  # the second request's four samples join
            for i, model in enumerate((on, off)):
                root = model.new_cache(1, 60)
                out = model.forward(prompts[1], root, last_only=True)
                caches[i] = caches[i].join(root.fork([0] * 4))
                root.release()
                tokens[i] = torch.cat([tokens[i], out[:, -1].argmax(-1).expand(4)])
        if step == 0:
            tokens = [torch.tensor([3, 50, 77, 9, 1]) for _ in tokens]  # the samples go different ways
        sharing = on._sharing(caches[0])
        assert sharing is not None and sharing.spans == (1 if step < 4 else 2)
        outs = [m.forward(t[:, None], c) for m, t, c in zip((on, off), tokens, caches, strict=True)]
        assert (outs[0].float() - outs[1].float()).abs().max().item() <= tol * max(1.0, outs[1].abs().max().item())
        tokens = [o[:, -1].argmax(-1) for o in outs]
        seen.append(tokens[1].tolist())
        if dtype == torch.float32:
            assert torch.equal(tokens[0], tokens[1]), step
    assert off._sharing(caches[1]) is None


@needs
def test_auto_turns_sharing_on_only_where_enough_is_shared(monkeypatch):
    import metaloom.models.engine.fused_step as llama

    model = _tiny().with_fused(KERNELS)
    auto = model.with_options(EngineOptions(shared_prefix_attention="auto"))
    on = model.with_options(EngineOptions(shared_prefix_attention="on"))
    root = model.new_cache(1, 60)
    model.forward(torch.randint(0, 103, (1, 20), generator=_g(6)), root)
    forked = root.fork([0, 0, 0])
    assert on._sharing(forked).saved_reads() == 2 * 20
    monkeypatch.setattr(llama, "AUTO_SHARED_READS", 41)
    assert auto._sharing(forked) is None
    monkeypatch.setattr(llama, "AUTO_SHARED_READS", 40)
    assert auto._sharing(forked) is not None
    windowed = _tiny("mistral", sliding_window=6).with_fused(KERNELS)
    windowed = windowed.with_options(EngineOptions(shared_prefix_attention="on"))
    root = windowed.new_cache(1, 60)
    windowed.forward(torch.randint(0, 103, (1, 20), generator=_g(6)), root)
    assert windowed._sharing(root.fork([0, 0])) is None  # rows of a sliding window attend their own spans


@needs
@pytest.mark.parametrize("threads", [1, 2])
def test_spans_cut_into_pieces_attend_as_one(threads):
    """A long shared span comes as pieces (one kernel task each); the result is the same."""
    rows, prefix, dim, heads, kv_heads = 5, 300, 64, 4, 2
    table = np.zeros((rows, prefix + 8), dtype=np.int64)
    table[:, :prefix] = np.arange(1, prefix + 1)
    for r in range(rows):
        table[r, prefix:prefix + 4] = np.arange(400 + 10 * r, 404 + 10 * r)
    lengths = np.full(rows, prefix + 3)
    whole, pieces = find_sharing(table, lengths, piece=10**6), find_sharing(table, lengths, piece=37)
    assert _spans(whole) == [(0, prefix, list(range(rows)))]
    assert [s[:2] for s in _spans(pieces)] == [(lo, min(lo + 37, prefix)) for lo in range(0, prefix, 37)]
    assert whole.saved_reads() == pieces.saved_reads() == (rows - 1) * prefix
    cos, sin = rope_tables(dim, 10000.0, None, 512, torch.float32, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(7))
    keys, values = torch.randn(500, kv_heads, dim, generator=_g(8)), torch.randn(500, kv_heads, dim, generator=_g(9))
    tl, tt = torch.from_numpy(lengths), torch.from_numpy(table)
    outs = [_attend(qkv, cos, sin, tl, tt, keys.clone(), values.clone(), heads, threads, s, torch.float32)
            for s in (None, whole, pieces)]
    assert (outs[0] - outs[1]).abs().max().item() <= 2e-6
    assert (outs[0] - outs[2]).abs().max().item() <= 2e-6
