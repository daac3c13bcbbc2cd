"""quant.c's panel layout (16 outputs side by side, `QuantWeight.panelled`): the regrouping
against an independent numpy model of the documented layout, the way back, the panel matmul
against a float64 reference, a row's independence of its batch, and the model using it.

Error bound of the panel matmul (`_panel_excess`): per (row, output) each
(sub-)block's n products q_i x_i are exact inside their fmas and summed in order (n - 1
roundings), the sum times its scale and the offset c off S (S the (sub-)block's input sum, at
most n - 1 roundings) are added with one rounding each, (sub-)blocks in order: |y - y_exact| <=
(n + 2 blocks + 2) u sum_i (|scale q_i| + |c off|) |x_i| to first order, with c off = m (Q4_1,
Q5_1), -8 d (Q4_0), -16 d (Q5_0), -dmin m (Q4_K, Q5_K, n = 32; Q2_K, n = 16), -32 d sc (Q6_K,
n = 16), -4 d (sc - 32) (Q3_K, n = 16), none for IQ4_NL / IQ4_XS (`offsets`). The 8-lane paths
sum a sub-block's even and odd elements in two chains added at its end (at most n roundings all
the same); without fma (generic x86) each product and each scaling is rounded as well, so the
bound doubles there (`_fma_factor`).

Every test runs once per instruction-set path this CPU runs (the ``kernel_path`` fixture): the
panel layout is the same bytes on every path, each path's matmul reads it."""


import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import isa, quant, quant_library
from metaloom.models.kernels.quant import QuantWeight, unpanel_numpy
from metaloom.models.kernels.quant_library import kernels
from metaloom.models.kernels.quant_types import QTYPES
from tests.test_quant_kernels import U, random_blocks, reference, weight

KERNELS = kernels().kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no quant kernels here: {kernels().reason}")

KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")


def test_every_path_has_the_panel_matmul_for_every_panel_type(kernel_path):
    assert KERNELS.panel_types == sum(1 << t for t in quant.PANEL_TYPES), kernel_path


def _fma_factor() -> int:
    return 1 if isa.has_fma(isa.chosen().name) else 2
ALL = sorted(quant.PANEL_TYPES)
PANEL_TYPES = pytest.mark.parametrize("qtype", ALL, ids=[QTYPES[t].name for t in ALL])
K_TYPES = (10, 11, 12, 13, 14, 23)  # super-blocks of 256
BYTES = {t: QTYPES[t].bytes for t in ALL}
HEAD = {2: 32, 3: 64, 6: 96, 7: 128, 20: 32}
QS = {2: 2, 20: 2, 3: 4, 6: 6, 7: 8}  # first quant byte of the 32-element types
QUANT_BYTES = {2: (2, 18), 20: (2, 18), 3: (4, 20), 6: (2, 22), 7: (4, 24), 10: (16, 80), 11: (0, 96), 12: (16, 144),
               13: (16, 176), 14: (0, 192), 23: (8, 136)}  # the bytes holding quants (and high bits) of a block
SUB = {10: 16, 11: 16, 14: 16}  # elements a sub-block with its own scale (others: 32)


def panel_reference(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """The panel layout of the 32-element types as quant.c's comment states it, element by element in numpy."""
    out, row = blocks.shape
    bb, nb, qs = BYTES[qtype], row // BYTES[qtype], QS[qtype]
    g_blocks = blocks.reshape(out, nb, bb)
    panels = np.zeros((out // 16, nb, 16 * bb), dtype=np.uint8)
    for p in range(out // 16):
        for b in range(nb):
            g = p * nb + b
            head_first = qtype in (2, 6, 20) and g % 2 == 1
            nib_at, head_at = (HEAD[qtype], 0) if head_first else (0, 256)
            dst = panels[p, b]
            words = np.zeros((4, 16), dtype=np.uint32)
            hi = np.zeros(16, dtype=np.uint32)
            for j in range(16):
                src = g_blocks[16 * p + j, b]
                dst[head_at + 2 * j:head_at + 2 * j + 2] = src[:2]  # d
                if qtype in (3, 7):
                    dst[head_at + 32 + 2 * j:head_at + 32 + 2 * j + 2] = src[2:4]  # m
                for e in range(32):
                    q = int(src[qs + e % 16]) >> (4 * (e // 16)) & 15
                    words[e // 8, j] |= np.uint32(q << (4 * (e % 8)))
                if qtype in (6, 7):
                    qh = int(src[qs - 4:qs].view(np.uint32)[0])
                    for i in range(32):  # element 8v + k's 5th bit at v + (4k + 4 if k < 7 else 0)
                        v, k = divmod(i, 8)
                        hi[j] |= np.uint32(((qh >> i) & 1) << (v + (4 * k + 4 if k < 7 else 0)))
            dst[nib_at:nib_at + 256] = words.view(np.uint8).reshape(-1)
            if qtype in (6, 7):
                hi_at = head_at + (32 if qtype == 6 else 64)
                dst[hi_at:hi_at + 64] = hi.view(np.uint8)
    return panels.reshape(out, row)


def offsets(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """Each weight's offset term c off [out, in] in float64 (quant.c's panel arithmetic: a
    weight is scale q + c off): the dequantised block with every quant (and high bit) 0, which
    is c off for every type with one (Q4_0 -8 d, Q4_1/Q5_1 m, the K types' -dmin m, Q6_K's
    -32 d sc, Q3_K's -4 d (sc - 32)); Q8_0 and the IQ4 types have none."""
    q = QTYPES[qtype]
    if qtype in (8, 20, 23):
        return np.zeros((blocks.shape[0], blocks.shape[1] // q.bytes * q.block))
    zero = blocks.copy().reshape(blocks.shape[0], -1, q.bytes)
    lo, hi = QUANT_BYTES[qtype]
    zero[:, :, lo:hi] = 0
    return reference(qtype, zero.reshape(blocks.shape)).astype(np.float64)


def _panel_excess(y: torch.Tensor, x: torch.Tensor, qtype: int, blocks: np.ndarray, factor: int | None = None) -> float:
    """max over outputs of |y - x W^T| / (bound u sum (|scale q| + |c off|) |x|), float64: <= 1
    passes, with bound (n + 2 sub-blocks + 2) (n elements a sub-block); ``factor``: the bound's
    multiple (None: the path under test's, `_fma_factor`)."""
    w = torch.from_numpy(reference(qtype, blocks)).double()
    factor = _fma_factor() if factor is None else factor
    c = torch.from_numpy(offsets(qtype, blocks))
    scale = x.double().abs() @ ((w - c).abs() + c.abs()).T
    exact = x.double() @ w.T
    sub = SUB.get(qtype, 32)
    bound = (sub + 2 * (w.shape[1] // sub) + 2) * factor
    return ((y.double() - exact).abs() / (bound * U * scale + 1e-300)).max().item()


def _sizes(qtype: int) -> list[tuple[int, int]]:
    return [(16, 256), (48, 768)] if qtype in K_TYPES else [(16, 32), (48, 96), (32, 576)]


@needs
@PANEL_TYPES
def test_panels_are_the_documented_regrouping_of_the_same_bytes(qtype):
    for out, inputs in _sizes(qtype):
        blocks = random_blocks(qtype, out, inputs, seed=out + inputs)
        _check_regrouping(qtype, blocks, inputs)


def _check_regrouping(qtype: int, blocks: np.ndarray, inputs: int) -> None:
    w = QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs)
    p = w.panelled()
    assert p.layout == "panel" and p.shape == w.shape and p.nbytes == w.nbytes
    if qtype in QS:  # element by element, as quant.c's comment states it
        assert np.array_equal(p.blocks.numpy(), panel_reference(qtype, blocks))
    assert torch.equal(p.gguf().blocks, w.blocks)  # C, back
    assert torch.equal(unpanel_numpy(qtype, p.blocks, inputs), w.blocks)  # numpy bit moves, back
    assert p.panelled() is p and p.gguf().gguf().layout == "gguf"


@needs
def test_every_bit_of_a_k_block_lands_where_the_layout_says():
    """One bit set at a time in a block of each type: the panel has exactly that bit set, at the
    place `_panel_sources` (the layout written out in Python) names."""
    for qtype in ALL:
        bb = BYTES[qtype]
        for bit in range(0, 16 * bb * 8, 97):  # a spread of bits over all 16 outputs' blocks
            blocks = np.zeros((16, bb), dtype=np.uint8)
            blocks.reshape(-1)[bit // 8] = 1 << (bit % 8)
            p = QuantWeight(qtype, torch.from_numpy(blocks), QTYPES[qtype].block).panelled()
            got = np.flatnonzero(np.unpackbits(p.blocks.numpy().reshape(-1), bitorder="little"))
            assert got.tolist() == [int(np.flatnonzero(quant._panel_sources(qtype, False) == bit)[0])], (qtype, bit)


@needs
@PANEL_TYPES
def test_panel_matmul_is_the_float64_product_to_float32_rounding(qtype):
    for out, inputs in ((16, 256), (48, 768)) if qtype in K_TYPES else ((16, 32), (48, 96), (64, 576)):
        blocks = random_blocks(qtype, out, inputs, seed=out)
        p = QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs).panelled()
        for rows in [*range(1, 18), 40]:
            x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
            x[0, 5] = 3e3  # an outlier input, as real activations have
            for threads in (1, 2):
                y = torch.empty(rows, out)
                KERNELS.panel_matmul(qtype, p.blocks, inputs, x, y, rows, threads)
                assert _panel_excess(y, x, qtype, blocks) <= 1, (out, inputs, rows, threads)
            xb = x.bfloat16()  # bfloat16 in and out: the same sums of the same inputs, rounded once
            assert torch.equal(p(xb), p(xb.float()).bfloat16())


@needs
@PANEL_TYPES
def test_a_rows_panel_result_does_not_depend_on_its_batch_or_the_threads(qtype):
    inputs = 256 if qtype in K_TYPES else 96
    # 144 outputs: 9 panels, so that each of 2 threads' shares holds AVX-512's 4 panels of 2-6 rows
    # (`few`: 4 panels x 2 rows, 2 x 4, and 5 and 6 rows in two groups) with panels left over
    w, _ = weight(qtype, 144, inputs, seed=3)
    p = w.panelled()
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([p(x[i:i + 1]) for i in range(40)])
    for rows in (2, 3, 4, 5, 6, 7, 13, 40):
        for threads in (1, 2):
            y = torch.empty(rows, 144)
            KERNELS.panel_matmul(qtype, p.blocks, inputs, x[:rows].contiguous(), y, rows, threads)
            assert torch.equal(y, alone[:rows]), (rows, threads)


@needs
@PANEL_TYPES
def test_a_panel_weight_dequantises_looks_up_rows_and_falls_back_like_its_blocks(qtype, monkeypatch):
    inputs = 256 if qtype in K_TYPES else 96
    w, ref = weight(qtype, 32, inputs, seed=5)
    p = w.panelled()
    assert torch.equal(p.dequantize(), torch.from_numpy(ref))
    assert torch.equal(p.rows(torch.tensor([31, 0, 7])), torch.from_numpy(ref)[[31, 0, 7]])
    x = torch.randn(quant.CROSSOVER_ROWS + 1, inputs, generator=torch.Generator().manual_seed(6))
    # float32 above CROSSOVER_ROWS: still the panel kernel (each row as alone); bfloat16 and more
    # than PANEL_CROSSOVER_ROWS rows: the dequantised weight and F.linear, as from GGUF's layout
    n = x.shape[0]
    assert torch.equal(p(x)[-3:], torch.cat([p(x[i:i + 1]) for i in range(n - 3, n)]))
    assert torch.equal(p(x.bfloat16()), w(x.bfloat16()))
    long = torch.randn(quant.PANEL_CROSSOVER_ROWS + 1, inputs, generator=torch.Generator().manual_seed(7))
    assert torch.equal(p(long), w(long))
    monkeypatch.setattr(quant, "kernels", lambda: quant_library.Availability(None, "forced off"))
    assert torch.equal(p.dequantize(), torch.from_numpy(ref))  # unpanelled by PyTorch
    assert torch.equal(p(x[:3]), w(x[:3]))


@needs
def test_panels_concatenate_as_panels_and_layouts_are_checked():
    ws = [weight(3, out, 64, seed=out)[0] for out in (16, 32)]
    fused = QuantWeight.cat([w.panelled() for w in ws])
    assert fused.layout == "panel"
    assert torch.equal(fused.gguf().blocks, QuantWeight.cat(ws).blocks)
    mixed = QuantWeight.cat([ws[0].panelled(), ws[1]])
    assert mixed.layout == "gguf" and torch.equal(mixed.blocks, QuantWeight.cat(ws).blocks)
    odd, _ = weight(3, 40, 64)  # 40 outputs: not whole panels
    assert odd.panelled() is odd
    q8, _ = weight(8, 32, 64)  # Q8_0: no panels
    assert q8.panelled() is q8
    with pytest.raises(InvalidParameter, match="layout"):
        QuantWeight(3, odd.blocks, 64, "panel")
    with pytest.raises(InvalidParameter, match="layout"):
        QuantWeight(8, q8.blocks, 64, "panel")
    with pytest.raises(InvalidParameter, match="layout"):
        QuantWeight(3, ws[0].blocks, 64, "rows")


@needs
def test_the_native_default_model_runs_on_panels():
    from metaloom.models.load import load

    model = load("default", weights="native").model
    assert model.layers[0].qkv.layout == "panel" and model.layers[5].down.layout == "panel"
