"""Triton's fused kernels for the GPU's static step (`metaloom.models.kernels.gpu_triton`), run
under Triton's interpreter on the CPU (float32; tests/conftest.py turns the interpreter on before
triton is imported), each against a PyTorch reference written out here."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.engine.rope import apply_rope, rope_tables

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter is off (these are CPU tests)", allow_module_level=True)

from metaloom.models.kernels import gpu_triton as gt


def test_add_rms_norm_adds_rounds_and_norms():
    g = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g), torch.randn(96, generator=g)
    res, out = gt.add_rms_norm(x, delta, w, 1e-5)
    torch.testing.assert_close(res, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(x + delta, (96,), w, 1e-5), rtol=1e-6, atol=1e-6)
    same, normed = gt.add_rms_norm(x, None, w, 1e-5)  # the first layer's norm: nothing to add
    assert same is x
    torch.testing.assert_close(normed, F.rms_norm(x, (96,), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rope_write_rotates_queries_and_keys_and_writes_keys_and_values_at_their_slots():
    h, hk, d, n = 6, 2, 16, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(n, (h + 2 * hk) * d, generator=g)
    cos, sin = rope_tables(d, 10000.0, None, 64, torch.float32, "cpu")
    positions, slots = torch.tensor([3, 7, 0, 12, 5]), torch.tensor([4, 9, 1, 30, 22])
    keys, values = torch.zeros(40, hk, d), torch.zeros(40, hk, d)
    q = gt.rope_write(qkv, cos, sin, positions, slots, keys, values, h, hk)
    heads = qkv.view(n, h + 2 * hk, 1, d)
    want = apply_rope(heads[:, :h + hk], cos[positions][:, None, None], sin[positions][:, None, None])[:, :, 0]
    torch.testing.assert_close(q, want[:, :h], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(keys[slots], want[:, h:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(values[slots], heads[:, h + hk:, 0], rtol=0, atol=0)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not keys[untouched].any() and not values[untouched].any()
    # a strided slot column (the static buffers' [R, 1] slice) reads the same slots
    wide = torch.zeros(n, 16, dtype=torch.long)
    wide[:, 0] = slots
    keys2, values2 = torch.zeros_like(keys), torch.zeros_like(values)
    gt.rope_write(qkv, cos, sin, positions, wide[:, :1].reshape(-1), keys2, values2, h, hk)
    torch.testing.assert_close(keys2, keys, rtol=0, atol=0)


def _attention(q, keys, values, table, lengths, window):
    """Per row and head: softmax over the row's attended slots, written out."""
    r, h, d = q.shape
    g = h // keys.shape[1]
    out = []
    for b in range(r):
        n = int(lengths[b])
        start = 0 if window is None else max(0, n - window)
        slots = table[b, start:n]
        ks = keys[slots].repeat_interleave(g, 1)  # [n, h, d]: query head j reads key head j // g
        vs = values[slots].repeat_interleave(g, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b], ks) * d ** -0.5, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, vs).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("h,hk,d", [(6, 2, 16), (4, 4, 32), (8, 1, 8)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunks", [1, 3])
def test_paged_attention_reads_each_rows_slots_through_its_table(h, hk, d, window, chunks):
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(60, hk, d, generator=g), torch.randn(60, hk, d, generator=g)
    table = torch.zeros(4, 64, dtype=torch.long)  # a wider buffer than the rows use: its row stride
    for b in range(4):
        table[b, :40] = torch.randperm(60, generator=g)[:40]
    table[3, :20] = table[1, :20]  # a fork: row 3 shares row 1's first 20 slots
    lengths = torch.tensor([1, 33, 40, 21])
    q = torch.randn(4, h, d, generator=g)
    got = gt.paged_attend(q, keys, values, table[:, :48], lengths, 48, d ** -0.5, window, chunks=chunks)
    torch.testing.assert_close(got, _attention(q, keys, values, table, lengths, window), rtol=1e-5, atol=1e-5)


def test_keys_are_split_into_chunks_of_whole_blocks_to_fill_the_device():
    assert gt.splits(8, 192, 32) == (32, 6)  # batch 1, 8 key-value heads: one block a chunk
    assert gt.splits(512, 512, 32) == (128, 4)  # 64 rows: 4 chunks of 4 blocks
    assert gt.splits(4096, 512, 32) == (512, 1)  # enough programs: no split, no combine
    assert gt.splits(8, 48, 32, chunks=3) == (32, 2)  # never more chunks than blocks
    assert gt.splits(16, 640, 32, chunks=3) == (224, 3)


def test_silu_mul():
    x = torch.randn(4, 2 * 50, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(gt.silu_mul(x), F.silu(x[:, :50]) * x[:, 50:], rtol=1e-6, atol=1e-6)


def test_when_the_kernels_run(monkeypatch):
    monkeypatch.setenv("METALOOM_TRITON", "on")
    assert gt.why_not(torch.device("cpu"), 64) is None  # the interpreter, on
    assert "power of two" in gt.why_not(torch.device("cpu"), 80)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "interpreter" in gt.why_not(torch.device("cpu"), 64)
    monkeypatch.setenv("METALOOM_TRITON", "auto")
    assert "interpreter" in gt.why_not(torch.device("cpu"), 64)  # auto: never on the CPU
    monkeypatch.setenv("METALOOM_TRITON", "off")
    assert gt.why_not(torch.device("cuda"), 64) == "METALOOM_TRITON=off"
    monkeypatch.setenv("METALOOM_TRITON", "sometimes")
    with pytest.raises(InvalidParameter, match="METALOOM_TRITON"):
        gt.mode()
