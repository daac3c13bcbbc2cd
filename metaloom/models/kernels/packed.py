"""CPU weights laid out for the GEMM libraries PyTorch ships (MKL and oneDNN).

A decode step reads every weight once, so its speed is the bytes/s of the matmul kernel. A
plain row-major [out, in] weight goes through kernels that are far from the machine's copy
bandwidth for the shapes decoding uses (one row per step, k + 1 rows per speculative verify).
Packing the weight once into each library's own blocked layout fixes both; measured on the
2-core Xeon (AVX-512, AMX) this project runs on, 30 layers of [3072, 576] weights:

| rows | float32 plain | float32 packed | bfloat16 plain | bfloat16 packed |
|---|---|---|---|---|
| 1 | 14.4 GB/s (`mv`) | 17.5-19.4 GB/s (MKL) | 8.5-9.1 GB/s (`mv`) | oneDNN (see below) |
| 11 | 5.2 GB/s (`F.linear`) | 10.0-10.6 GB/s (oneDNN) | 7.1 GB/s | 9.5 GB/s (oneDNN) |
| 300 | 250 ms | 234 ms | 94 ms | 90 ms |

MKL's packed GEMM is packed for one fixed row count (we use 1); oneDNN's blocked layout serves
any row count, one row included: in bfloat16 (AVX512-BF16 here) one row through oneDNN beat `mv`
2.5x on the [49152, 576] head and on 30 [3072, 576] weights, and greedy decoding at batch 1 ran
2.0x faster on a quiet machine (31 -> 62 tok/s, the two kernels alternated in one process, 3
rounds; tokens agree to bfloat16 rounding, which is all two summation orders can promise).

The packed copies sit next to the plain weight, which stays the source of
truth (quantised self-draft, speculator heads and `num_parameters` read it), so packing costs
two (float32) or one (bfloat16) extra copies of the linear weights; `load` packs only when that
fits comfortably in memory. Results agree with the plain kernels to float rounding (the
summation order differs), as the equivalence tests check.

bfloat16 is packed only where oneDNN has bfloat16 kernels for this CPU (AVX-512 BW/VL/DQ, or
AVX-NE-CONVERT; checked by asking oneDNN and by packing a small weight, not assumed): elsewhere
(AVX2, NEON) its reorder raises, and PyTorch's own bfloat16 products are slower than float32
(measured on an AVX2 Zen 3, 2 threads: `mv` over SmolLM2's gate_up 15 GB/s against 35 in
float32, a 354-row `F.linear` 79 ms against 19). There a bfloat16 weight multiplies through
metaloom's own kernel instead (`Bf16Linear`: quant.c's BF16 path, which widens each value by a
shift and accumulates in float32, 20-30 GB/s per core), reading the same storage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from metaloom.models.kernels.onednn import bf16_gemm
from metaloom.models.kernels.quant import QuantWeight
from metaloom.models.kernels.quant_library import kernels


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """y = x @ weight.T through the packed copies; a `metaloom.models.engine.llama.MatMul`."""

    weight: torch.Tensor  # [out, in], row-major: the source of truth
    rows: torch.Tensor  # oneDNN blocked layout, for 2 or more rows
    one_row: torch.Tensor | None  # MKL packed for exactly one row (float32 only)

    def numel(self) -> int:
        return self.weight.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, inp = self.weight.shape
        flat = x.reshape(-1, inp)
        if flat.shape[0] == 1 and self.one_row is not None:
            y = torch.ops.mkl._mkl_linear(flat, self.one_row, self.weight, None, 1)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.rows, None, "none", [], "")
        return y.view(*x.shape[:-1], out)


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this PyTorch build has the packed kernels for ``dtype`` on ``device`` and this CPU
    (bfloat16: `bf16_gemm`)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bf16_gemm()
    return torch.backends.mkl.is_available()


@dataclass(frozen=True, eq=False)
class Bf16Linear:
    """y = x @ weight.T for a bfloat16 weight through metaloom's own bfloat16 kernel (quant.c's
    BF16 type over the same storage: no copy), where oneDNN has none (see the module's note); a
    `metaloom.models.engine.llama.MatMul`. Products and sums in float32, one rounding of y to x's dtype."""

    weight: torch.Tensor  # [out, in] bfloat16, row-major: the source of truth
    blocks: QuantWeight  # the same bytes as ggml's BF16 type

    def numel(self) -> int:
        return self.weight.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def own_bf16_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `Bf16Linear` applies: bfloat16 on the CPU with metaloom's kernels built."""
    return dtype == torch.bfloat16 and device.type == "cpu" and kernels().kernels is not None


def own_bf16(weight: torch.Tensor) -> Bf16Linear:
    """A [out, in] bfloat16 CPU weight (in a multiple of 32) through metaloom's own kernel."""
    w = weight.contiguous()
    return Bf16Linear(w, QuantWeight(30, w.view(torch.uint8), w.shape[1]))


def pack(weight: torch.Tensor) -> PackedLinear:
    """Pack a [out, in] float32 or bfloat16 CPU weight (see `packing_available`)."""
    w = weight.contiguous()
    rows = torch.ops.mkldnn._reorder_linear_weight(w, 16)  # the row count is a tuning hint only
    one_row = torch.ops.mkl._mkl_reorder_linear_weight(w, 1) if w.dtype == torch.float32 else None
    return PackedLinear(w, rows, one_row)


def extra_bytes(weight_bytes: int, dtype: torch.dtype) -> int:
    """Memory the packed copies add for ``weight_bytes`` of linear weights."""
    return weight_bytes * (2 if dtype == torch.float32 else 1)


def fits_in_memory(extra: int, share: float = 0.25) -> bool:
    """True when ``extra`` bytes are under ``share`` of physical memory (unknown: False)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return False
    return extra <= share * total
