"""The C kernels built for aarch64 (the neon path, with the dot-product extension, and the
generic one: plain ARMv8-A) by Debian's cross-compiler and run under qemu-aarch64 through a small
driver (tests/aarch64/driver.c), against the same numpy/gguf references and bounds as the x86
suites: every quantised type's matmul, dequantisation and quantisation, the panel regrouping and
panel matmul, Q8_0's q8 panels (quant_q8_0.h, `sdot`), the fused decode kernels, float32 and bfloat16,
and draw.c's row maxima.

This checks exactness, not speed: qemu emulates. Run by ``make test-aarch64`` (and so by CI),
not by ``make test``: it needs ``aarch64-linux-gnu-gcc`` (Debian's gcc-aarch64-linux-gnu) and
``qemu-aarch64`` (qemu-user), and the module is skipped, saying which is missing, without them.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from metaloom.models.engine.rope import rope_tables
from metaloom.models.kernels import quant
from metaloom.models.kernels.quant_types import QTYPES
from tests.test_fused import _reference_attend
from tests.test_quant_kernels import U, random_blocks, weight
from tests.test_quant_panels import _panel_excess, panel_reference

ROOT = Path(__file__).resolve().parents[2]
CC, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
MISSING = [f"{tool} (Debian package {pkg})" for tool, pkg in ((CC, "gcc-aarch64-linux-gnu"), (QEMU, "qemu-user"))
           if shutil.which(tool) is None]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"missing {', '.join(MISSING)}")
# the paths an aarch64 CPU runs, with the flags metaloom.models.kernels.isa gives them there
PATHS = {"neon": ("-march=armv8.2-a+dotprod",), "generic": ()}
TYPES = sorted(QTYPES)
PANEL_TYPES = sorted(quant.PANEL_TYPES)


@dataclass(frozen=True)
class Out:
    """An output buffer of ``shape`` and ``dtype`` for the driver to fill."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class InOut:
    """A buffer the driver reads and writes back (the KV pool, a residual updated in place)."""

    tensor: torch.Tensor


class Driver:
    """The kernels of one aarch64 build, called through qemu: `call` takes ints, floats, None,
    input tensors, `Out` and `InOut` in the C function's order and returns (rc, outputs)."""

    def __init__(self, exe: Path, work: Path) -> None:
        self.exe, self.work, self.n = exe, work, 0

    def call(self, fn: str, *args: object) -> tuple[int, list[torch.Tensor]]:
        argv, outs = [], []
        for a in args:
            self.n += 1
            path = self.work / f"buf{self.n}"
            if isinstance(a, bool | int):
                argv.append(f"i:{int(a)}")
            elif isinstance(a, float):
                argv.append(f"f:{a!r}")
            elif a is None:
                argv.append("null")
            elif isinstance(a, torch.Tensor):
                path.write_bytes(a.contiguous().view(torch.uint8).numpy().tobytes())
                argv.append(f"in:{path}")
            elif isinstance(a, Out):
                nbytes = math.prod(a.shape) * a.dtype.itemsize
                argv.append(f"out:{path}:{nbytes}")
                outs.append((path, a.shape, a.dtype))
            elif isinstance(a, InOut):
                path.write_bytes(a.tensor.contiguous().view(torch.uint8).numpy().tobytes())
                argv.append(f"io:{path}")
                outs.append((path, tuple(a.tensor.shape), a.tensor.dtype))
            else:
                raise TypeError(type(a))
        run = subprocess.run([QEMU, "-L", SYSROOT, str(self.exe), fn, *argv], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr
        tensors = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8).view(dt).reshape(shape).clone()
                   for p, shape, dt in outs]
        return int(run.stdout.strip()), tensors


@pytest.fixture(scope="module", params=sorted(PATHS))
def driver(request, tmp_path_factory) -> Driver:
    work = tmp_path_factory.mktemp(f"aarch64-{request.param}")
    exe = work / "driver"
    kernels = ROOT / "metaloom/models/kernels"
    sources = [kernels / "quant.c", kernels / "fused.c", kernels / "draw.c", ROOT / "tests/aarch64/driver.c"]
    build = subprocess.run([CC, "-O2", "-fno-math-errno", "-fopenmp", *PATHS[request.param], *map(str, sources), "-o",
                            str(exe), "-lm"], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    return Driver(exe, work)


def _bound(inputs: int, qtype: int) -> float:
    """The GGUF-layout kernel's bound on 8 lanes with fma (tests/test_quant_kernels.py says why)."""
    return (5 * inputs / 32 if qtype == 8 else inputs / 8) + 3


def _excess(y: torch.Tensor, x: torch.Tensor, ref: np.ndarray, c: float) -> float:
    w = torch.from_numpy(ref).double()
    scale = x.double().abs() @ w.abs().T
    return ((y.double() - x.double() @ w.T).abs() / (c * U * scale + 1e-300)).max().item()


def _inputs(qtype: int) -> int:
    return 768 if QTYPES[qtype].block == 256 else 96


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # scales past float16, on purpose
@pytest.mark.parametrize("qtype", TYPES, ids=[QTYPES[t].name for t in TYPES])
def test_matmul_dequantize_and_quantize(driver, qtype):
    inputs = _inputs(qtype)
    w, ref = weight(qtype, 37, inputs, seed=21)
    for rows, threads in ((1, 1), (5, 2), (17, 1)):
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
        rc, (y,) = driver.call("quant_matmul", qtype, w.blocks, 37, inputs, x, 0, Out((rows, 37), torch.float32), 0,
                               rows, threads)
        assert rc == 0 and _excess(y, x, ref, _bound(inputs, qtype)) <= 1, (rows, threads)
        _, (yb,) = driver.call("quant_matmul", qtype, w.blocks, 37, inputs, x.bfloat16(), 1,
                               Out((rows, 37), torch.bfloat16), 1, rows, threads)
        _, (yf,) = driver.call("quant_matmul", qtype, w.blocks, 37, inputs, x.bfloat16().float(), 0,
                               Out((rows, 37), torch.float32), 0, rows, threads)
        assert torch.equal(yb, yf.bfloat16())  # bfloat16 in and out: the same sums, rounded once
    rc, (dense,) = driver.call("quant_dequantize", qtype, w.blocks, 37, inputs, None, 37, Out((37, inputs), torch.float32),
                               0, 2)
    assert rc == 0 and torch.equal(dense.view(torch.int32), torch.from_numpy(ref).view(torch.int32))
    name = QTYPES[qtype].name
    if name in quant.QUANTIZERS:
        import gguf

        x = torch.randn(8, 96) * torch.logspace(-9, 6, 8).unsqueeze(1)
        rc, (blocks,) = driver.call("quant_quantize", qtype, x, 0, 8, 96, Out((8, QTYPES[qtype].row_bytes(96)),
                                                                              torch.uint8), 1)
        assert np.array_equal(blocks.numpy(), gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType[name]))


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=[QTYPES[t].name for t in PANEL_TYPES])
def test_panel_regrouping_and_panel_matmul(driver, qtype):
    inputs = 256 if QTYPES[qtype].block == 256 else 96
    blocks = random_blocks(qtype, 48, inputs, seed=22)
    w = quant.QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs)
    rc, (panels,) = driver.call("quant_panel", qtype, w.blocks, 48, inputs, Out(tuple(w.blocks.shape), torch.uint8), 0, 2)
    assert rc == 0
    expected = panel_reference(qtype, blocks) if QTYPES[qtype].block == 32 else w.panelled().blocks.numpy()
    assert np.array_equal(panels.numpy(), expected)  # the same bytes as the layout says (and as on x86)
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(24))
    x[0, 5] = 3e3  # an outlier input, as real activations have
    first = []
    for rows in (1, 3, 40):  # one row (the tile kernel), a few and many (the rows kernel)
        rc, (y,) = driver.call("quant_panel_matmul", qtype, panels, 48, inputs, x[:rows], 0,
                               Out((rows, 48), torch.float32), 0, rows, 2)
        assert rc == 0 and _panel_excess(y, x[:rows], qtype, blocks, factor=1) <= 1, rows
        first.append(y[0])
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], first[2])  # a row's result: alone or in a batch



def test_q8_0_panels_and_their_integer_products(driver):
    """quant_q8_0.h on aarch64 (NEON `sdot`, and the portable path): the panels are x86's bytes,
    the products are each block's exact int32 sum then one fma chain (as tests/test_quant_q8.py
    holds the x86 paths to), a row's result is the same alone or in a batch, and a tied
    embedding's rows read from the panels are the file's values."""
    g = torch.Generator().manual_seed(26)
    out, inputs, rows = 48, 160, 21
    w = quant.quantize(torch.randn(out, inputs, generator=g), "Q8_0")
    b = w.blocks.view(out, inputs // 32, 34)
    b[:2, :, 2:] = torch.tensor([-128, 127], dtype=torch.int8).repeat(16).view(torch.uint8)  # both ends of int8
    rc, (panels,) = driver.call("quant_panel", w.qtype, w.blocks, out, inputs, Out(tuple(w.blocks.shape), torch.uint8),
                                0, 2)
    assert rc == 0 and torch.equal(panels, w.with_activations("q8").panelled().blocks)
    x = torch.randn(rows, inputs, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    rc, (q, d, _) = driver.call("quant_q8_inputs", x, 0, rows, inputs, Out((rows, inputs), torch.int8),
                                Out((rows, inputs // 32), torch.float32), Out((rows, 3 * inputs // 32), torch.int32))
    assert rc == 0
    quants = b[:, :, 2:].contiguous().view(torch.int8).long()
    scales = b[:, :, :2].contiguous().view(torch.float16).float()[..., 0]
    isum = torch.einsum("obk,rbk->rbo", quants, q.long().view(rows, -1, 32))
    acc = torch.zeros(rows, out)
    for k in range(inputs // 32):  # fma(isum, d dx, acc); see tests/test_quant_q8.py on the float64 step
        acc = (isum[:, k].double() * (scales[:, k][None, :] * d[:, k][:, None]).double() + acc.double()).float()
    rc, (y,) = driver.call("quant_panel_matmul_q8", w.qtype, panels, out, inputs, x, 0, Out((rows, out), torch.float32),
                           0, rows, 2)
    assert rc == 0 and torch.equal(y, acc)
    rc, (one,) = driver.call("quant_panel_matmul_q8", w.qtype, panels, out, inputs, x[5:6], 0,
                             Out((1, out), torch.float32), 0, 1, 1)
    assert rc == 0 and torch.equal(one[0], y[5])
    ids = torch.tensor([0, 1, 17, 47])
    rc, (table,) = driver.call("quant_q8_0_panel_rows", panels, out, inputs, ids, 4, Out((4, inputs), torch.float32), 0)
    assert rc == 0 and torch.equal(table, w.rows(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_decode_kernels(driver, dtype):
    bf = int(dtype == torch.bfloat16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(23)
    x = (torch.randn(3, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(3, 576, generator=g).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    _, (x_after, y) = driver.call("residual_rms_norm", InOut(x), delta, norm_w, Out((3, 576), dtype), 3, 576, 1e-5, bf)
    expected_x = x + delta
    assert torch.equal(x_after, expected_x)
    expected = torch.nn.functional.rms_norm(expected_x, (576,), norm_w, 1e-5)
    assert (y.float() - expected.float()).abs().max() <= tol * expected.abs().max()
    gate_up = (torch.randn(2, 128, generator=g) * 4).to(dtype)
    _, (s,) = driver.call("silu_mul", gate_up, Out((2, 64), dtype), 2, 64, bf)
    expected = torch.nn.functional.silu(gate_up[:, :64].float()) * gate_up[:, 64:].float()
    assert (s.float() - expected).abs().max() <= tol * max(1.0, expected.abs().max().item())
    heads, kv_heads, dim, rows, cap, slots = 6, 2, 64, 4, 40, 160
    lengths = torch.tensor([0, 7, 33, 20])
    cos, sin = rope_tables(dim, 10000.0, None, 64, dtype, torch.device("cpu"))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(slots, generator=g)[:rows * cap].view(rows, cap).clone()
    table[3, :20] = table[2, :20]
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = _reference_attend(qkv, cos, sin, lengths, table, ref_keys, ref_values, heads, None)
    rc, (k_after, v_after, out) = driver.call("rope_attend", qkv, cos, sin, lengths, table, cap, InOut(keys), InOut(values),
                                              None, None, Out((rows, heads * dim), dtype), rows, heads, kv_heads, dim, 0, 2,
                                              bf, None)
    assert rc == 0
    assert (out.float() - expected.float()).abs().max() <= tol * max(1.0, expected.abs().max().item())
    assert (k_after.float() - ref_keys.float()).abs().max() <= tol * max(1.0, ref_keys.abs().max().item())
    assert torch.equal(v_after, ref_values)


def test_fused_attention_over_an_int8_pool(driver):
    """rope_attend over an int8 pool (codes widened by NEON on that path): the new key and
    value quantised as the Python write does (codes within one step of it, the same scales),
    the output as attention over the dequantised pool computes it."""
    from metaloom.models.engine.kv_int8 import dequantize, quantize

    heads, kv_heads, dim, rows, cap, slots = 6, 2, 64, 4, 40, 160
    g = torch.Generator().manual_seed(29)
    lengths = torch.tensor([0, 7, 33, 20])
    cos, sin = rope_tables(dim, 10000.0, None, 64, torch.float32, torch.device("cpu"))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    codes_k, scales_k = quantize(torch.randn(slots, kv_heads, dim, generator=g))
    codes_v, scales_v = quantize(torch.randn(slots, kv_heads, dim, generator=g))
    table = torch.randperm(slots, generator=g)[:rows * cap].view(rows, cap).clone()
    table[3, :20] = table[2, :20]
    rc, (k_after, v_after, ks_after, vs_after, out) = driver.call(
        "rope_attend", qkv, cos, sin, lengths, table, cap, InOut(codes_k), InOut(codes_v), InOut(scales_k),
        InOut(scales_v), Out((rows, heads * dim), torch.float32), rows, heads, kv_heads, dim, 0, 2, 0, None)
    assert rc == 0
    # the reference writes the exact rotated new keys and values into a float copy of the pool
    ref_keys, ref_values = dequantize(codes_k, scales_k, torch.float32), dequantize(codes_v, scales_v, torch.float32)
    expected = _reference_attend(qkv, cos, sin, lengths, table, ref_keys, ref_values, heads, None)
    new = table[torch.arange(rows), lengths]
    want_k, want_ks = quantize(ref_keys[new])
    want_v, want_vs = quantize(ref_values[new])
    assert (k_after[new].int() - want_k.int()).abs().max() <= 1 and torch.allclose(ks_after[new], want_ks, rtol=1e-6)
    assert torch.equal(v_after[new], want_v) and torch.equal(vs_after[new], want_vs)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[new] = False
    assert torch.equal(k_after[untouched], codes_k[untouched]) and torch.equal(ks_after[untouched], scales_k[untouched])
    # attention read the dequantised pool: off from the float reference only by the new keys' rounding
    assert (out - expected).abs().max() <= 2e-2 * max(1.0, expected.abs().max().item())


def test_row_maxima(driver):
    """draw.c's `rows_max`: each row's maximum (NaN where it holds one) and the first index of its
    largest entry, over vectors of 8 lanes in 4 chains and a tail, against torch's max."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-6, 7, (6, 1000), generator=g).float()  # few values: the maximum is tied
    x[0, -1] = 50.0  # alone in the tail
    x[1, 9] = x[1, 41] = 60.0  # tied across passes: the first wins
    x[2].fill_(float("-inf"))  # nothing above -inf: index 0
    x[3, 5] = float("nan")  # a NaN in the vectors
    x[4, 999] = float("nan")  # and one in the tail
    rc, (values, index) = driver.call("rows_max", x, 6, 1000, Out((6,), torch.float32), Out((6,), torch.int64), 1)
    assert rc == 0
    best = x.max(dim=-1)
    clean = [0, 1, 2, 5]
    assert torch.equal(values[clean], best.values[clean]) and torch.equal(index[clean], best.indices[clean])
    assert values[3:5].isnan().all() and ((index >= 0) & (index < 1000)).all()
