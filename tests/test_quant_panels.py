"""quant.c's panel layout (16 outputs side by side, `QuantWeight.panelled`): the regrouping
against an independent numpy model of the documented layout, the way back, the panel matmul
against a float64 reference, a row's independence of its batch, and the model using it.

Error bound of the panel matmul (`_panel_excess`, `_k_excess`): per (row, output) each
(sub-)block's n products q_i x_i are exact inside their fmas and summed in order (n - 1
roundings), the sum times its scale and the offset c off S (S the (sub-)block's input sum, at
most n - 1 roundings) are added with one rounding each, (sub-)blocks in order: |y - y_exact| <=
(n + 2 blocks + 2) u sum_i (|scale q_i| + |c off|) |x_i| to first order, with c off = m (Q4_1),
-8 d (Q4_0), -16 d (Q5_0), -dmin m (Q4_K, n = 32), -32 d sc (Q6_K, n = 16). The 8-lane paths
sum a sub-block's even and odd elements in two chains added at its end (at most n roundings all
the same); without fma (generic x86) each product and each scaling is rounded as well, so the
bound doubles there (`_fma_factor`).

Every test runs once per instruction-set path this CPU runs (the ``kernel_path`` fixture): the
panel layout is the same bytes on every path, each path's matmul reads it."""


import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import isa, quant
from metaloom.models.kernels.quant import QuantWeight, kernels, unpanel_numpy
from tests.test_quant_kernels import U, random_blocks, reference, weight

KERNELS = kernels().kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no quant kernels here: {kernels().reason}")

KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")


def test_every_path_has_the_panel_matmul_for_every_panel_type(kernel_path):
    assert KERNELS.panel_types == sum(1 << t for t in quant.PANEL_TYPES), kernel_path


def _fma_factor() -> int:
    return 1 if isa.has_fma(isa.chosen().name) else 2
PANEL_TYPES = pytest.mark.parametrize("qtype", [2, 3, 6, 12, 14], ids=["Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
SMALL_TYPES = pytest.mark.parametrize("qtype", [2, 3, 6], ids=["Q4_0", "Q4_1", "Q5_0"])
K_TYPES = (12, 14)
BYTES = {2: 18, 3: 20, 6: 22, 12: 144, 14: 210}
HEAD = {2: 32, 3: 64, 6: 96}


def panel_reference(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """The panel layout as quant.c's comment states it, element by element in numpy."""
    out, row = blocks.shape
    bb, nb, qs = BYTES[qtype], row // BYTES[qtype], {2: 2, 3: 4, 6: 6}[qtype]
    g_blocks = blocks.reshape(out, nb, bb)
    panels = np.zeros((out // 16, nb, 16 * bb), dtype=np.uint8)
    for p in range(out // 16):
        for b in range(nb):
            g = p * nb + b
            head_first = qtype != 3 and g % 2 == 1
            nib_at, head_at = (HEAD[qtype], 0) if head_first else (0, 256)
            dst = panels[p, b]
            words = np.zeros((4, 16), dtype=np.uint32)
            hi = np.zeros(16, dtype=np.uint32)
            for j in range(16):
                src = g_blocks[16 * p + j, b]
                dst[head_at + 2 * j:head_at + 2 * j + 2] = src[:2]  # d
                if qtype == 3:
                    dst[head_at + 32 + 2 * j:head_at + 32 + 2 * j + 2] = src[2:4]  # m
                for e in range(32):
                    q = int(src[qs + e % 16]) >> (4 * (e // 16)) & 15
                    words[e // 8, j] |= np.uint32(q << (4 * (e % 8)))
                if qtype == 6:
                    qh = int(src[2:6].view(np.uint32)[0])
                    for i in range(32):  # element 8v + k's 5th bit at v + (4k + 4 if k < 7 else 0)
                        v, k = divmod(i, 8)
                        hi[j] |= np.uint32(((qh >> i) & 1) << (v + (4 * k + 4 if k < 7 else 0)))
            dst[nib_at:nib_at + 256] = words.view(np.uint8).reshape(-1)
            if qtype == 6:
                dst[head_at + 32:head_at + 96] = hi.view(np.uint8)
    return panels.reshape(out, row)


def _panel_excess(y: torch.Tensor, x: torch.Tensor, qtype: int, blocks: np.ndarray, factor: int | None = None) -> float:
    """max over outputs of |y - x W^T| / (bound u sum (|d q| + |c|) |x|), float64: <= 1 passes;
    ``factor``: the bound's multiple (None: the path under test's, `_fma_factor`)."""
    w = torch.from_numpy(reference(qtype, blocks)).double()
    factor = _fma_factor() if factor is None else factor
    if qtype in K_TYPES:  # the offset, per element: Q4_K's -dmin m (its w's minimum over q), Q6_K's -32 d sc
        return _k_excess(y, x, qtype, blocks, w, factor)
    out, nb = blocks.shape[0], blocks.shape[1] // BYTES[qtype]
    b = blocks.reshape(out, nb, BYTES[qtype])
    d = torch.from_numpy(b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64))
    c = torch.from_numpy(b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)) if qtype == 3 else \
        d * (-8.0 if qtype == 2 else -16.0)
    c = c.repeat_interleave(32, dim=1)  # [out, in]
    scale = x.double().abs() @ ((w - c).abs() + c.abs()).T
    exact = x.double() @ w.T
    bound = (32 + 2 * nb + 2) * factor
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
    if qtype not in K_TYPES:  # element by element, as quant.c's comment states it
        assert np.array_equal(p.blocks.numpy(), panel_reference(qtype, blocks))
    assert torch.equal(p.gguf().blocks, w.blocks)  # C, back
    assert torch.equal(unpanel_numpy(qtype, p.blocks, inputs), w.blocks)  # numpy bit moves, back
    assert p.panelled() is p and p.gguf().gguf().layout == "gguf"


@needs
def test_every_bit_of_a_k_block_lands_where_the_layout_says():
    """One bit set at a time in a Q4_K / Q6_K block: the panel has exactly that bit set, at the
    place `_panel_sources` (the layout written out in Python) names."""
    for qtype in K_TYPES:
        bb = BYTES[qtype]
        for bit in range(0, 16 * bb * 8, 97):  # a spread of bits over all 16 outputs' blocks
            blocks = np.zeros((16, bb), dtype=np.uint8)
            blocks.reshape(-1)[bit // 8] = 1 << (bit % 8)
            p = QuantWeight(qtype, torch.from_numpy(blocks), 256).panelled()
            got = np.flatnonzero(np.unpackbits(p.blocks.numpy().reshape(-1), bitorder="little"))
            assert got.tolist() == [int(np.flatnonzero(quant._panel_sources(qtype, False) == bit)[0])], (qtype, bit)


def _k_excess(y: torch.Tensor, x: torch.Tensor, qtype: int, blocks: np.ndarray, w: torch.Tensor, factor: int) -> float:
    """The bound for Q4_K (sub-blocks of 32, offset -dmin m) and Q6_K (of 16, offset -32 d sc),
    the offsets recovered from the dequantised weight of quants 0 (Q4_K) and 32 (Q6_K)."""
    zero = blocks.copy().reshape(blocks.shape[0], -1, BYTES[qtype])
    zero[:, :, 16:] = 0 if qtype == 12 else zero[:, :, 16:]  # Q4_K: every quant 0, w = -dmin m
    zero[:, :, :192] = zero[:, :, :192] if qtype == 12 else 0  # Q6_K: every quant 0, w = -32 d sc
    c = torch.from_numpy(reference(qtype, zero.reshape(blocks.shape))).double()
    scale = x.double().abs() @ ((w - c).abs() + c.abs()).T
    exact = x.double() @ w.T
    sub = 32 if qtype == 12 else 16
    bound = (sub + 2 * (w.shape[1] // sub) + 2) * factor
    return ((y.double() - exact).abs() / (bound * U * scale + 1e-300)).max().item()


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
    w, _ = weight(qtype, 80, inputs, seed=3)
    p = w.panelled()
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([p(x[i:i + 1]) for i in range(40)])
    for rows in (2, 3, 5, 13, 40):
        for threads in (1, 2):
            y = torch.empty(rows, 80)
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
    monkeypatch.setattr(quant, "kernels", lambda: quant.Availability(None, "forced off"))
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
