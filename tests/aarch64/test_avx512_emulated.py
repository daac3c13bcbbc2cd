"""quant.c's AVX-512 path run on a CPU without AVX-512: built with its AVX-512 code selected
(``-DMETALOOM_EMULATE_AVX512``) and the AVX-512 intrinsics taken from SIMDe (Debian's
libsimde-dev, portable implementations; tests/aarch64/simde/immintrin.h), then checked against
the same gguf references and bounds as the native suites: every type's matmul and dequantisation
in GGUF's layout, the quantisers, the panel regrouping and the panel matmul, rows independent of
their batch.

What this shows: the AVX-512 code's logic (decoders, lookups, panel words, tiles) gives the right
values. What it cannot show: that the compiler's real AVX-512 instructions behave as SIMDe's
emulation of them does, or anything about speed. An AVX-512 machine runs the native path in the
main suites (the ``kernel_path`` fixture). Run with ``make test-aarch64`` beside the qemu suite
(this directory holds the builds the CPU cannot run natively); skipped, saying why, without an
x86-64 AVX2 CPU, a C compiler or SIMDe's headers.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from metaloom.models.kernels import isa, quant, quant_library
from metaloom.models.kernels.cbuild import compiler
from metaloom.models.kernels.quant_types import BY_NAME, QTYPES
from tests.aarch64.test_under_qemu import _excess
from tests.test_quant_kernels import random_blocks, weight
from tests.test_quant_panels import _panel_excess

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("simde")
SIMDE = Path("/usr/include/simde/x86/avx512.h")
CC = compiler()
WHY = ("needs an x86-64 CPU with AVX2" if isa.machine() != "x86_64" or "avx2" not in isa.runnable()
       else "no C compiler" if CC is None
       else f"no SIMDe headers at {SIMDE} (Debian: apt-get install libsimde-dev)" if not SIMDE.exists()
       else None)
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
TYPES = sorted(QTYPES)
PANEL_TYPES = sorted(quant.PANEL_TYPES)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> quant_library.QuantKernels:
    out = tmp_path_factory.mktemp("avx512-emulated") / "quant.so"
    build = subprocess.run([str(CC), "-O1", "-fno-math-errno", "-shared", "-fPIC", *isa.flags("avx2"), "-fopenmp",
                            "-DMETALOOM_EMULATE_AVX512", f"-I{SHIM}", str(quant_library.SOURCE), "-o", str(out), "-lm"],
                           capture_output=True, text=True, timeout=1800, env={**os.environ, "LC_ALL": "C"})
    assert build.returncode == 0, build.stderr[-3000:]
    k = quant_library._bind(ctypes.CDLL(str(out)), out, "avx512")
    assert k.panel_types == sum(1 << t for t in quant.PANEL_TYPES)
    return k


def _bound(inputs: int) -> float:
    """The GGUF-layout kernel's bound on 16 lanes with fma (tests/test_quant_kernels.py says why)."""
    return inputs / 16 + 4


def _inputs(qtype: int) -> int:
    return 768 if QTYPES[qtype].block == 256 else 96


@pytest.mark.parametrize("qtype", TYPES, ids=[QTYPES[t].name for t in TYPES])
def test_matmul_and_dequantize_in_ggufs_layout(emulated, qtype):
    inputs = _inputs(qtype)
    w, ref = weight(qtype, 37, inputs, seed=31)
    x = torch.randn(17, inputs, generator=torch.Generator().manual_seed(32))
    alone = []
    for rows, threads in ((1, 1), (5, 2), (17, 1)):
        y = torch.empty(rows, 37)
        emulated.matmul(qtype, w.blocks, inputs, x[:rows].contiguous(), y, rows, threads)
        assert _excess(y, x[:rows], ref, _bound(inputs)) <= 1, rows
        alone.append(y[0])
        yb = torch.empty(rows, 37, dtype=torch.bfloat16)
        emulated.matmul(qtype, w.blocks, inputs, x[:rows].bfloat16(), yb, rows, threads)
        emulated.matmul(qtype, w.blocks, inputs, x[:rows].bfloat16().float(), y, rows, threads)
        assert torch.equal(yb, y.bfloat16())  # bfloat16 in and out: the same sums, rounded once
    assert torch.equal(alone[0], alone[1]) and torch.equal(alone[0], alone[2])  # a row alone or in a batch
    dense = torch.empty(37, inputs)
    emulated.dequantize(qtype, w.blocks, inputs, None, dense, 2)
    assert torch.equal(dense.view(torch.int32), torch.from_numpy(ref).view(torch.int32))


@pytest.mark.parametrize("name", quant.QUANTIZERS)
def test_quantisers(emulated, name):
    x = torch.randn(8, 96) * torch.logspace(-9, 6, 8).unsqueeze(1)
    t = BY_NAME[name]
    out = torch.empty(8, QTYPES[t].row_bytes(96), dtype=torch.uint8)
    emulated.quantize(t, x, out, 1)
    assert np.array_equal(out.numpy(), gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType[name]))


@pytest.mark.parametrize("qtype", PANEL_TYPES, ids=[QTYPES[t].name for t in PANEL_TYPES])
def test_panel_regrouping_and_panel_matmul(emulated, qtype):
    inputs = 256 if QTYPES[qtype].block == 256 else 96
    blocks = random_blocks(qtype, 48, inputs, seed=33)
    w = quant.QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs)
    panels = torch.empty_like(w.blocks)
    emulated.panel(qtype, w.blocks, inputs, panels)
    assert torch.equal(panels, torch.from_numpy(np.ascontiguousarray(_python_panels(qtype, blocks, inputs))))
    back = torch.empty_like(w.blocks)
    emulated.panel(qtype, back, inputs, panels, back=True)
    assert torch.equal(back, w.blocks)
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(34))
    x[0, 5] = 3e3  # an outlier input, as real activations have
    first = []
    for rows in (1, 3, 40):  # one row (the 8/4/2/1-panel tiles), a few and many (`prows`)
        y = torch.empty(rows, 48)
        emulated.panel_matmul(qtype, panels, inputs, x[:rows].contiguous(), y, rows, 2)
        assert _panel_excess(y, x[:rows], qtype, blocks, factor=1) <= 1, rows
        first.append(y[0])
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], first[2])


def test_q8_inputs_and_a_q8_panel_matmul(emulated):
    """quant_q8.h's AVX-512 statement of the inputs' quantisation (vector max, sums and
    narrowing), against the PyTorch statement bit for bit, and a Q4_1 panel matmul under q8: the
    product of the dequantised weight and inputs within the native suite's bound, and a row alone
    gives the bits it gives in a batch."""
    from metaloom.models.kernels.quant_torch import q8_inputs_torch
    from tests.test_quant_q8 import _q8_excess

    g = torch.Generator().manual_seed(35)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-4, 3, 5).unsqueeze(1)
    x[0, :32] = 0.0
    x[1, :32] = torch.arange(-16, 16) * 0.5  # ties
    x[2, 64:96] = float("inf")
    x[3, 100] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        q, d, s = emulated.q8_inputs(x.to(dtype))
        tq, td = q8_inputs_torch(x.to(dtype))
        assert torch.equal(q, tq) and torch.equal(d.isnan(), td.isnan()) and torch.equal(d[~d.isnan()], td[~td.isnan()])
        assert torch.equal(s[:, :8], q.view(5, 8, 32).int().sum(-1)) and torch.equal(s[:, 8:], q.view(5, 16, 16).int().sum(-1))
    q41 = BY_NAME["Q4_1"]
    blocks = random_blocks(q41, 48, 96, seed=36)
    w = quant.QuantWeight(q41, torch.from_numpy(blocks.copy()), 96).with_activations("q8").panelled()
    xs = torch.randn(19, 96, generator=g)
    y = torch.empty(19, 48)
    emulated.matmul_q8(q41, w.blocks, 96, xs, y, 19, 2, w.layout)
    assert _q8_excess(y, xs, q41, blocks, 1) <= 1
    alone = torch.empty(1, 48)
    emulated.matmul_q8(q41, w.blocks, 96, xs[7:8].contiguous(), alone, 1, 1, w.layout)
    assert torch.equal(alone[0], y[7])


def _python_panels(qtype: int, blocks: np.ndarray, inputs: int) -> np.ndarray:
    """The panel layout from the Python statement of it (`metaloom.models.kernels.panels`), by
    inverting its bit sources: the same bytes every path's regrouping must give."""
    from metaloom.models.kernels import panels

    bb, out = QTYPES[qtype].bytes, blocks.shape[0]
    nb = inputs // QTYPES[qtype].block
    g = blocks.reshape(out // 16, 16, nb, bb).transpose(0, 2, 1, 3).reshape(out // 16 * nb, 16 * bb)
    bits = np.unpackbits(g, axis=1, bitorder="little")
    result = np.empty_like(bits)
    for odd in (False, True):
        rows = np.arange(odd, g.shape[0], 2)
        result[rows] = bits[np.ix_(rows, panels.panel_sources(qtype, odd))]
    return np.packbits(result, axis=1, bitorder="little").reshape(out, -1)

