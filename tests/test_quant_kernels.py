"""The block-quantised matmul kernels (metaloom.models.kernels.quant, quant.c) against gguf's own numpy
dequantisers: every type, odd sizes, batches, threads, bfloat16, the PyTorch fallback, the
quantisers, real blocks from the default model's GGUF, and typed errors for bad input.

Every test runs once per instruction-set path this CPU runs (the ``kernel_path`` fixture:
avx512, avx2, generic on x86).

Error bound of the kernel (`_kernel_bound`): every block decodes to exactly the float32 values
gguf.quants.dequantize gives, so the only error is float32 summation. For one output, each of the
W lanes of the accumulator (16 on avx512, 8 elsewhere) sums in / W products with fmas (one
rounding per term), then log2(W) levels of pairwise adds sum the lanes: |y - y_exact| <= (in / W
+ log2 W) u sum_i |W_oi x_ri| to first order, u = 2^-24. With 8 lanes Q8_0 sums each block's 4
products per lane afresh and adds the sum times d with one more fma (5 roundings per 32 inputs);
without fma (generic x86) every product is rounded too (twice the terms). (Seen: at most ~3.5 u
sum |W x|.) PyTorch's F.linear, of unknown order, gets the order-free bound (in + 2) u sum |W x|."""

import math
import os
import struct
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.kernels import isa, quant, quant_library
from metaloom.models.kernels.onednn import bf16_gemm
from metaloom.models.kernels.quant import CROSSOVER_ROWS, QuantWeight, from_gguf
from metaloom.models.kernels.quant_library import build, kernels
from metaloom.models.kernels.quant_torch import dequantize_torch
from metaloom.models.kernels.quant_types import QTYPES

AVAILABLE = kernels()
KERNELS = AVAILABLE.kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no quant kernels here: {AVAILABLE.reason}")

KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")
U = 2.0**-24
K_TYPES = (10, 11, 12, 13, 14, 23)  # 256 elements a block
QWEN = os.environ.get("METALOOM_QWEN_GGUF", "/work/models/qwen2.5-coder-0.5b.gguf")  # a benchmark model, not in CI


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f16_field(raw: np.ndarray, at: int, values: np.ndarray) -> None:
    """Write finite float16 ``values`` [out, nb] at byte ``at`` of every block of raw [out, nb, bytes]."""
    raw[:, :, at:at + 2] = values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


# the float16 scale fields of the types gguf has no quantiser for: (byte offset, both signs?) in a block
SCALE_FIELDS = {
    10: ((80, False), (82, False)),  # Q2_K: d, dmin (mins are subtracted)
    11: ((108, True),),  # Q3_K: d
    12: ((0, False), (2, False)),  # Q4_K: d, dmin
    13: ((0, False), (2, False)),  # Q5_K: d, dmin
    14: ((208, True),),  # Q6_K: d
    20: ((0, True),),  # IQ4_NL: d
    23: ((0, True),),  # IQ4_XS: d
}


def random_blocks(qtype: int, out: int, inputs: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, row_bytes]: gguf's own quantiser where it has one, else random quants with
    moderate finite scales."""
    rng = _rng(seed)
    scale = rng.uniform(0.1, 3, (out, 1))
    scale[out // 2] = 1e-5  # a row whose float16 scales (or F16 values) are subnormal
    w = rng.standard_normal((out, inputs)).astype(np.float32) * scale.astype(np.float32)
    if qtype in (2, 3, 6, 7, 8):
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    if qtype == 1:
        return w.astype(np.float16).view(np.uint8)
    if qtype == 30:
        return torch.from_numpy(w).bfloat16().view(torch.uint8).numpy()
    q = QTYPES[qtype]
    nb = inputs // q.block
    raw = rng.integers(0, 256, (out, nb, q.bytes), dtype=np.uint8)
    for at, signed in SCALE_FIELDS[qtype]:
        d = rng.uniform(1e-3, 2e-2, (out, nb)) * scale / 3
        _f16_field(raw, at, d * rng.choice([-1, 1], (out, nb)) if signed else d)
    return raw.reshape(out, -1)


def reference(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """gguf's float32 dequantisation [out, in]."""
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).reshape(blocks.shape[0], -1)


def weight(qtype: int, out: int, inputs: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    blocks = random_blocks(qtype, out, inputs, seed)
    return QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs), reference(qtype, blocks)


def _excess(y: torch.Tensor, x: torch.Tensor, ref: np.ndarray, c: float) -> float:
    """max over outputs of |y - x W^T| / (c u sum |W x|) in float64: <= 1 passes."""
    w = torch.from_numpy(ref).double()
    exact = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    return ((y.double() - exact).abs() / (c * U * scale + 1e-300)).max().item()


def _kernel_bound(inputs: int, qtype: int | None = None) -> float:
    """The GGUF-layout kernel's bound, in units of u sum |W x|, on the path under test."""
    path = isa.chosen().name
    lanes = 16 if path == "avx512" else 8
    terms = 5 * inputs / 32 if lanes == 8 and qtype == 8 else inputs / lanes
    return terms * (1 if isa.has_fma(path) else 2) + math.log2(lanes)


def _inputs(qtype: int) -> tuple[int, int]:
    return (256, 768) if qtype in K_TYPES else (32, 96)


def _matmul(w: QuantWeight, x: torch.Tensor, threads: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel itself (whatever the number of rows)."""
    assert KERNELS is not None
    y = torch.empty(x.shape[0], w.out_features, dtype=out_dtype or x.dtype)
    KERNELS.matmul(w.qtype, w.blocks, w.in_features, x.contiguous(), y, x.shape[0], threads)
    return y


TYPES = pytest.mark.parametrize("qtype", sorted(QTYPES), ids=[QTYPES[t].name for t in sorted(QTYPES)])


@needs
@TYPES
@pytest.mark.parametrize("out", [1, 37])
def test_kernel_matmul_is_the_float64_product_to_float32_rounding(qtype, out):
    for inputs in _inputs(qtype):
        w, ref = weight(qtype, out, inputs, seed=out + inputs)
        for rows in [*range(1, 18), 40]:  # 9 to 40: more than one chunk of 8 rows
            x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
            for threads in (1, 2):
                y = _matmul(w, x, threads)
                assert _excess(y, x, ref, _kernel_bound(inputs, qtype)) <= 1, (rows, threads, inputs)
                # bfloat16 in and out: the same float32 sums of the same (exactly converted)
                # inputs, each rounded once to nearest even
                xb = x.bfloat16()
                assert torch.equal(_matmul(w, xb, threads), _matmul(w, xb.float(), threads).bfloat16())
                assert torch.equal(_matmul(w, xb, threads, torch.float32), _matmul(w, xb.float(), threads))


@needs
def test_bfloat16_outputs_round_ties_to_even_and_keep_nan():
    """Outputs that are exact ties between two bfloat16 values: an identity weight passes x
    through exactly (float32 in, bfloat16 out), so each output is rounded once, as PyTorch
    rounds (to nearest, ties to even); a NaN stays a NaN."""
    eye = QuantWeight(30, torch.eye(32, dtype=torch.bfloat16).view(torch.uint8).contiguous(), 32)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8)] * 8)
    expected = ties.bfloat16()
    assert expected[:2].tolist() == [1.0, 1 + 2**-6]  # ties to even, both ways
    assert torch.equal(_matmul(eye, ties.unsqueeze(0), 1, torch.bfloat16)[0], expected)
    ties[5] = float("nan")  # 0 * NaN: every output
    assert torch.isnan(_matmul(eye, ties.unsqueeze(0), 1, torch.bfloat16)).all()


@needs
@TYPES
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(qtype):
    """One summation order per (row, output): a row alone, in a batch of 13 or of 40, over 1 or 2
    threads, gives the same bits (speculative verification can compare with plain steps)."""
    inputs = _inputs(qtype)[1]
    w, _ = weight(qtype, 45, inputs, seed=3)
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([_matmul(w, x[i:i + 1], 1) for i in range(40)])
    assert torch.equal(_matmul(w, x[:13], 2), alone[:13])
    assert torch.equal(_matmul(w, x, 2), alone)
    assert torch.equal(_matmul(w, x, 1), alone)


@needs
def test_a_q8_0_head_streamed_one_output_at_a_time_gives_the_same_bits():
    """A Q8_0 weight of 16 MiB or more (a model's head) is read one output at a time at batch 1
    (quant.c's STREAM_BYTES), where smaller ones and more rows go T_ONE or more outputs side by
    side: the same sums, bit for bit, and each the float64 product within the kernel's bound; the
    last outputs (past any multiple of a tile) included."""
    out, inputs = 16389, 1024  # 17.8 MB of blocks; 16389 = 4 * 4097 + 1
    g = torch.Generator().manual_seed(7)
    w = quant.quantize(torch.randn(out, inputs, generator=g), "Q8_0")
    assert w.nbytes >= 16 << 20
    ref = reference(8, w.blocks.numpy())
    x = torch.randn(3, inputs, generator=g)
    for threads in (1, 2):
        batch = _matmul(w, x, threads)
        for i in range(3):
            alone = _matmul(w, x[i:i + 1], threads)
            assert torch.equal(alone[0], batch[i]), (i, threads)
            assert _excess(alone, x[i:i + 1], ref, _kernel_bound(inputs, 8)) <= 1


@needs
@TYPES
def test_dequantize_and_rows_are_ggufs_values_bit_for_bit(qtype):
    inputs = _inputs(qtype)[1]
    w, ref = weight(qtype, 37, inputs, seed=5)
    expected = torch.from_numpy(ref)
    got = w.dequantize()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # bits: -0.0 stays -0.0
    assert torch.equal(w.dequantize(torch.bfloat16), expected.bfloat16())
    ids = torch.tensor([[36, 0, 5], [5, 17, 36]])
    assert torch.equal(w.rows(ids).view(torch.int32), expected[ids].view(torch.int32))
    assert torch.equal(w.rows(ids, torch.bfloat16), expected[ids].bfloat16())
    assert w.rows(torch.zeros(0, dtype=torch.int64)).shape == (0, inputs)


@TYPES
def test_torch_fallback_decodes_the_same_bits(qtype):
    inputs = _inputs(qtype)[1]
    w, ref = weight(qtype, 37, inputs, seed=6)
    got = dequantize_torch(qtype, w.blocks, inputs)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(ref).view(torch.int32))


@TYPES
def test_without_the_kernels_a_weight_computes_the_same_results(qtype, monkeypatch):
    inputs = _inputs(qtype)[0]
    w, ref = weight(qtype, 37, inputs, seed=7)
    x = torch.randn(3, 2, inputs, generator=torch.Generator().manual_seed(8))
    with_kernels = w(x)
    monkeypatch.setattr(quant, "kernels", lambda: quant_library.Availability(None, "forced off"))
    assert w._kernels() is None
    y = w(x)
    assert y.shape == (3, 2, 37)
    assert _excess(y.reshape(6, 37), x.reshape(6, inputs), ref, inputs + 2) <= 1
    assert (y - with_kernels).abs().max().item() <= 1e-5 * max(1.0, y.abs().max().item())
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))
    assert torch.equal(w.rows(torch.tensor([4, 0])), torch.from_numpy(ref)[[4, 0]])
    xb = x.bfloat16()
    assert torch.equal(w(xb), _linear_float32(xb, ref).bfloat16())


def _linear_float32(x: torch.Tensor, ref: np.ndarray) -> torch.Tensor:
    return torch.nn.functional.linear(x.float(), torch.from_numpy(ref))


@needs
@TYPES
def test_calls_above_the_crossover_dequantise_and_use_f_linear(qtype):
    inputs = _inputs(qtype)[0]
    w, ref = weight(qtype, 37, inputs, seed=9)
    rows = CROSSOVER_ROWS + 3
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(10))
    assert _excess(w(x), x, ref, inputs + 2) <= 1
    # bfloat16: PyTorch's bfloat16 GEMM where oneDNN has one for this CPU, else the float32 product
    # rounded once (PyTorch's emulated bfloat16 GEMM is 4x slower than float32 there)
    if bf16_gemm():
        expected = torch.nn.functional.linear(x.bfloat16(), torch.from_numpy(ref).bfloat16())
    else:
        expected = _linear_float32(x.bfloat16(), ref).bfloat16()
    assert torch.equal(w(x.bfloat16()), expected)
    small = x[:CROSSOVER_ROWS]
    assert torch.equal(w(small), _matmul(w, small, 1))  # at the crossover: still the kernel


FMA_SENSITIVE = [  # float32 bits, found by search
    [1060995406, 3213611592, 1064928331, 3206257858, 1065049707, 1070360296, 1071422139, 3219362188, 3205684587,
     3202069332, 3215678503, 3215281222, 1043089525, 3206538176, 3189829562, 1060708166, 1053501865, 3180716605,
     3209776151, 1068652145, 1061033292, 3210759137, 3211971989, 3216685489, 1073254986, 3198509425, 3215188380,
     1071301546, 3212038903, 1061765065, 1054989540, 1050795100],
    [3202621236, 3216638551, 1055598063, 3185559895, 1061560974, 1059751207, 3215455191, 995974014, 3208183044,
     1060712656, 1061813654, 1048024360, 1071069392, 3209044178, 3212429743, 3207198930, 1062770695, 3214905190,
     1009490440, 1058241919, 1060004488, 3196137011, 3222550944, 1072749987, 3157189900, 3198566671, 1051951858,
     3182727636, 1040286952, 1045568899, 1061623921, 3206958686],
]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the 1e7 block, on purpose
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantize_matches_ggufs_quantiser_bit_for_bit(name):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 256, generator=g) * torch.rand(40, 1, generator=g) * 4
    w[0, :32] = 0.0  # an all-zero block, and one of -0.0
    w[1, :32] = -0.0
    w[2, :32] *= 1e-7  # a scale below float16's normal range
    w[3, :32] *= 1e7  # a scale above float16's range (inf)
    w[4, 32:64] = torch.linspace(-1, 1, 32)  # ties in the rounding
    w[5, :] = w[5, :].abs()  # Q4_1's min > 0
    # Q4_0 blocks where x * id + 8.5 fused into one fma rounds across a .5 boundary: a compiler
    # contracting the quantiser's two roundings into one would change a quant
    w[6:8, :32] = torch.tensor(FMA_SENSITIVE, dtype=torch.int64).to(torch.int32).view(torch.float32)
    qtype = gguf.GGMLQuantizationType[name]
    for dense in (w, w.bfloat16()):
        got = quant.quantize(dense, name)
        assert got.qtype == int(qtype) and got.shape == (40, 256)
        assert np.array_equal(got.blocks.numpy(), gguf.quants.quantize(dense.float().numpy(), qtype))
    assert torch.equal(quant.quantize(w, "BF16").dequantize(), w.bfloat16().float())
    assert torch.equal(quant.quantize(w, "F16").dequantize(), w.half().float())


@needs
def test_q4_0_q4_1_q8_0_quantise_in_c_not_numpy(monkeypatch):
    w = torch.randn(64, 576)
    expected = {n: gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[n]) for n in quant.QUANTIZERS}

    def refuse(*args):
        raise AssertionError("the numpy quantiser was called")

    monkeypatch.setattr(gguf.quants, "quantize", refuse)
    for name, blocks in expected.items():
        assert np.array_equal(quant.quantize(w, name).blocks.numpy(), blocks)


def gguf_tensors(path: str) -> dict[str, SimpleNamespace]:
    """A GGUF file's tensors as gguf.GGUFReader names them (name, tensor_type, shape in ggml
    order, data: a memory map of the bytes), from a minimal parse of the header: GGUFReader
    parses every metadata array element into objects, 4 s for the default model's vocabulary
    and 12 s for Qwen's."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = raw.data
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("Q")
        pos += n
        return bytes(buf[pos - n:pos]).decode()

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def skip(kind: int) -> object:
        """Step over one value of GGUF type ``kind``; a scalar's value is returned."""
        nonlocal pos
        if kind == 8:
            return string()
        if kind == 9:
            (inner, count) = take("IQ")
            if inner in scalars:
                pos += struct.calcsize(scalars[inner]) * count
            else:
                for _ in range(count):
                    skip(inner)
            return None
        return take(scalars[kind])[0]

    magic, _version, n_tensors, n_kv = take("4sIQQ")
    assert magic == b"GGUF"
    alignment = 32
    for _ in range(n_kv):
        key = string()
        (kind,) = take("I")
        value = skip(kind)
        if key == "general.alignment":
            alignment = int(value)  # type: ignore[call-overload]
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = take("I")
        dims = take("Q" * n_dims)
        kind, offset = take("IQ")
        infos.append((name, kind, dims, offset))
    start = -(-pos // alignment) * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        if kind in QTYPES and len(dims) == 2:
            q = QTYPES[kind]
            nbytes = dims[1] * q.row_bytes(dims[0])
            data = raw[start + offset:start + offset + nbytes].reshape(dims[1], -1)
            tensors[name] = SimpleNamespace(name=name, tensor_type=kind, shape=list(dims), data=data)
    return tensors


def _check_real(tensor: SimpleNamespace, rows: int = 512) -> str:
    """The first ``rows`` outputs of a GGUF tensor: matmul (1 and 5 rows of x), rows and
    dequantize against gguf; returns its type's name."""
    cut = SimpleNamespace(**{**vars(tensor), "data": tensor.data[:rows], "shape": [tensor.shape[0], min(rows, tensor.shape[1])]})
    w = from_gguf(cut)
    ref = reference(w.qtype, w.blocks.numpy())
    assert w.shape == ref.shape
    for n in (1, 5):
        x = torch.randn(n, w.in_features, generator=torch.Generator().manual_seed(n))
        assert _excess(w(x), x, ref, _kernel_bound(w.in_features, w.qtype) if KERNELS else w.in_features + 2) <= 1
    ids = torch.tensor([0, w.out_features - 1, w.out_features // 3])
    assert torch.equal(w.rows(ids), torch.from_numpy(ref)[ids])
    return QTYPES[w.qtype].name


def test_real_blocks_of_the_default_model():
    from metaloom.models.find import default_model_path

    tensors = gguf_tensors(default_model_path())  # the default model is part of the install
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight"):
        assert _check_real(tensors[name]) == "Q4_1"
    assert _check_real(tensors["token_embd.weight"], rows=3000) == "Q8_0"


@pytest.mark.skipif(not os.path.exists(QWEN), reason=f"{QWEN} is not on this machine")
def test_real_blocks_of_qwen_q5_0_q6_k_q4_k():
    tensors = gguf_tensors(QWEN)
    names = ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.2.ffn_down.weight",
             "blk.0.attn_v.weight")
    assert {_check_real(tensors[name], rows=256) for name in names} == {"Q5_0", "Q6_K", "Q4_K", "Q8_0"}


def test_cat_fuses_outputs_in_order():
    ws = [weight(3, out, 64, seed=out)[0] for out in (5, 3, 8)]
    fused = QuantWeight.cat(ws)
    assert fused.shape == (16, 64) and fused.numel() == 16 * 64 and fused.nbytes == 16 * 40
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(12))
    assert torch.equal(fused(x), torch.cat([w(x) for w in ws], dim=-1))
    with pytest.raises(InvalidParameter, match="one type"):
        QuantWeight.cat([ws[0], weight(2, 4, 64)[0]])
    with pytest.raises(InvalidParameter, match="one type"):
        QuantWeight.cat([ws[0], weight(3, 4, 96)[0]])
    with pytest.raises(InvalidParameter, match="at least one"):
        QuantWeight.cat([])


def test_bad_input_is_a_typed_error_naming_the_problem():
    w, _ = weight(2, 4, 64)
    with pytest.raises(UnsupportedModel, match="99"):
        QuantWeight(99, w.blocks, 64)
    with pytest.raises(UnsupportedModel, match=r"16.*Q2_K=10.*IQ4_XS=23"):  # IQ2_XXS: a real ggml type, not read here
        QuantWeight(16, w.blocks, 64)
    with pytest.raises(InvalidParameter, match="qtype"):
        QuantWeight("Q4_0", w.blocks, 64)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="blocks"):  # Q4_0 rows of 64 inputs are 36 bytes
        QuantWeight(2, torch.zeros(4, 40, dtype=torch.uint8), 64)
    with pytest.raises(InvalidParameter, match="blocks"):
        QuantWeight(2, w.blocks.float(), 64)
    with pytest.raises(InvalidParameter, match="blocks"):
        QuantWeight(2, torch.zeros(36, 4, dtype=torch.uint8).T, 64)  # not contiguous
    with pytest.raises(InvalidParameter, match="in_features"):
        QuantWeight(2, w.blocks, 48)
    with pytest.raises(InvalidParameter, match=r"\[\.\.\., 64\]"):
        w(torch.zeros(2, 63))
    assert w(torch.zeros(0, 3, 64)).shape == (0, 3, 4)  # no rows: no error, no work
    with pytest.raises(InvalidParameter, match=r"x\.dtype"):
        w(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(InvalidParameter, match="ids"):
        w.rows(torch.tensor([0, 4]))
    with pytest.raises(InvalidParameter, match="ids"):
        w.rows(torch.tensor([-1]))
    with pytest.raises(InvalidParameter, match=r"ids\.dtype"):
        w.rows(torch.tensor([0.0]))
    with pytest.raises(InvalidParameter, match="qtype"):
        quant.quantize(torch.zeros(4, 256), "Q4_K")
    with pytest.raises(InvalidParameter, match=r"w\.shape"):
        quant.quantize(torch.zeros(4, 48), "Q8_0")
    with pytest.raises(UnsupportedModel, match="Q9"):
        quant.quantize(torch.zeros(4, 64), "Q9")


def test_a_bf16_weight_whose_inputs_the_kernel_cannot_walk_uses_pytorch():
    dense = torch.randn(3, 40)
    w = QuantWeight(30, dense.bfloat16().view(torch.uint8), 40)  # 40 inputs: not a multiple of 32
    assert w._kernels() is None
    x = torch.randn(2, 40)
    assert torch.allclose(w(x), x @ dense.bfloat16().float().T, rtol=1e-5, atol=1e-5)


def test_build_without_a_working_compiler_gives_a_reason_not_an_error(tmp_path):
    missing = build(tmp_path, compiler=str(tmp_path / "no-such-cc"))
    assert missing.kernels is None and "no-such-cc" in missing.reason
    broken = build(tmp_path, compiler="/bin/false")
    assert broken.kernels is None and "failed" in broken.reason
    assert not list(tmp_path.rglob("*.so"))


