"""GGUF block-quantised weights kept as they are in the file, and matmuls over them (`quant.c`).

Why: a batch-1 decode step reads every weight once, so its time is the bytes it reads. A GGUF
file's Q4_1 weight is 5 bits per value where a float32 copy is 32: reading the blocks directly,
decoding them in registers, is the speed-up (and the memory saving) of running a quantised
model at all. PyTorch has no kernel for these formats; dequantising to float first would read
and write the full-size weight every step.

A `QuantWeight` is a weight [out, in] as ``blocks`` uint8 [out, row_bytes]: each row is that
output's blocks along the input dimension, GGUF's own layout (ggml type ids: F16=1, Q4_0=2,
Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14, IQ4_NL=20,
IQ4_XS=23, BF16=30: every type of the Q4_K_M, Q5_K_M, Q3_K_M, Q2_K, Q4_0/Q5_0/Q5_1/Q8_0 and
IQ4_NL/IQ4_XS files people download). Calling it on x [..., in] (float32 or bfloat16) gives
x W^T [..., out] in x's dtype:

- up to `CROSSOVER_ROWS` rows: the C kernel, which decodes each block (once per 8 rows of x) in
  registers into the exact float32 values gguf.quants.dequantize gives and accumulates in
  float32 (activations are never quantised, unlike llama.cpp), so results match a float64
  reference to float32 rounding, and a row's result does not depend on the other rows in the
  call or on the thread count;
- a model's weights of every quantised type but Q8_0 are regrouped when it is built
  (`QuantWeight.panelled`: 16 outputs side by side, the same bytes, on every kernel path): the
  panel kernel reads them 1.2-1.7x as fast per core on AVX-512 and about 2x on AVX2 (Zen 3),
  where widening GGUF's bytes into lanes costs more still (quant.c says why). It sums each
  (sub-)block's exact products q x first, then scales by the (sub-)block's scale and adds its
  offset term (m, -8 d, -16 d, -dmin m or -32 d scale times the (sub-)block's input sum): the
  same float32 rounding level in another order, and again a row's result does not depend on the
  other rows or the threads;
- more rows (for float32 x on panels, more than `PANEL_CROSSOVER_ROWS`): the weight dequantised
  to x's dtype (by the C kernel) and `F.linear`, where a
  dense GEMM's arithmetic rate pays for dequantising (bfloat16 x: the weight rounds to bfloat16;
  on a CPU where oneDNN has no bfloat16 GEMM, `metaloom.models.kernels.onednn.bf16_gemm`, the product is
  taken in float32 and rounded once, PyTorch's emulated bfloat16 GEMM being 4x slower there);
- without a C compiler: the same values from PyTorch bit operations, then `F.linear` (slow, but
  the same results).

The C file is compiled on first use like `metaloom.models.kernels.fused` (`metaloom.models.kernels.cbuild`),
into ``~/.cache/metaloom/kernels/<hash>/quant.so``; `kernels()` says why not where it cannot be.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.kernels import cbuild, panels

SOURCE = Path(__file__).with_name("quant.c")
ABI_VERSION = 3  # must match quant.c
# Up to this many rows per call, the kernel; above, dequantise + F.linear. Measured with
# scripts/quant_kernel_speed.py (2 threads, Zen 4): F.linear first wins between 96 and 256 rows
# on weights of 1 to 5 MB of blocks (SmolLM2-135M's gate_up, Qwen2.5-0.5B's ffn_down; within 10%
# either way at 128 but for Q5_0), and past 256 on Qwen's gate_up (dequantising 35 MB costs more).
CROSSOVER_ROWS = 128
# The same for a weight in the panel layout with float32 x: the panel kernel decodes each group
# of quants once for 32 rows and then runs fmas at about the rate of a float32 GEMM, with no
# weight to regroup and dequantise first. Measured against regroup + dequantise + F.linear
# (2 threads, Zen 4): 1.2-3x faster at 129 and 354 rows on SmolLM2's gate_up and Qwen's
# gate_up/down, 0.8-1.3x at 1024. bfloat16 x keeps CROSSOVER_ROWS: F.linear in bfloat16 wins
# above about 200 rows.
PANEL_CROSSOVER_ROWS = 512
# Below this many bytes of blocks, one thread: an OpenMP parallel region costs a microsecond or
# two, and two threads first won at ~22 KB of Q4_1 (4.4 us on one)
PARALLEL_MIN_BYTES = 32 * 1024
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@dataclass(frozen=True)
class QType:
    """A ggml tensor type: ``block`` elements stored in ``bytes`` bytes (GGUF's sizes);
    ``kernel_block``: what the input dimension must be a multiple of for the C kernels (raw
    F16/BF16 values are walked 32 at a time)."""

    name: str
    block: int
    bytes: int
    kernel_block: int

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block * self.bytes


QTYPES: dict[int, QType] = {
    1: QType("F16", 1, 2, 32),
    2: QType("Q4_0", 32, 18, 32),
    3: QType("Q4_1", 32, 20, 32),
    6: QType("Q5_0", 32, 22, 32),
    7: QType("Q5_1", 32, 24, 32),
    8: QType("Q8_0", 32, 34, 32),
    10: QType("Q2_K", 256, 84, 256),
    11: QType("Q3_K", 256, 110, 256),
    12: QType("Q4_K", 256, 144, 256),
    13: QType("Q5_K", 256, 176, 256),
    14: QType("Q6_K", 256, 210, 256),
    20: QType("IQ4_NL", 32, 18, 32),
    23: QType("IQ4_XS", 256, 136, 256),
    30: QType("BF16", 1, 2, 32),
}
BY_NAME: dict[str, int] = {q.name: k for k, q in QTYPES.items()}
QUANTIZERS = ("Q4_0", "Q4_1", "Q8_0")  # quant.c's; Q5_0, F16 and BF16 by gguf / PyTorch
_FLOATS = (torch.float32, torch.bfloat16)


def qtype_id(qtype: int | str) -> int:
    """A type id from an id or a name ("Q4_0"); an unknown one is an `UnsupportedModel`."""
    key = BY_NAME.get(qtype) if isinstance(qtype, str) else qtype
    if not isinstance(key, int) or key not in QTYPES:
        names = ", ".join(f"{q.name}={k}" for k, q in QTYPES.items())
        raise UnsupportedModel(f"GGML tensor type {qtype!r} is not one the quantised matmul reads ({names})")
    return key


# ---- the C library ----------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantKernels:
    """The loaded library. Arguments are checked by `QuantWeight`, not here: every tensor must be
    a contiguous CPU tensor of the documented shape and dtype."""

    lib: ctypes.CDLL
    path: str
    openmp: bool = False  # compiled with OpenMP: threads > 1 splits outputs
    panel_types: int = 0  # bit t set: type t has the panel layout's matmul in this build
    isa: str = ""  # the instruction-set path it was built for (metaloom.models.kernels.isa)
    q8_types: int = 0  # bit t set: type t has the q8-activation matmuls (quant_q8.h)

    def matmul_q8(self, qtype: int, blocks: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor,
                  rows: int, threads: int = 1, layout: str = "gguf") -> None:
        """As `matmul` (``layout`` "panel": as `panel_matmul`), with x quantised to int8 per 32
        inputs and integer products (quant_q8.h)."""
        fn = self.lib.quant_panel_matmul_q8 if layout == "panel" else self.lib.quant_matmul_q8
        rc = fn(qtype, blocks.data_ptr(), blocks.shape[0], in_features, x.data_ptr(), x.dtype == torch.bfloat16,
                y.data_ptr(), y.dtype == torch.bfloat16, rows, threads)
        if rc:
            _check(rc, "quant_matmul_q8")

    def q8_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [rows, in] (float32 or bfloat16, contiguous) as the q8 kernels quantise it: int8 quants
        [rows, in], float32 scales [rows, in / 32], int32 sums [rows, 3 in / 32] (per 32, then per 16)."""
        rows, n = x.shape
        q = torch.empty(rows, n, dtype=torch.int8)
        d = torch.empty(rows, n // 32)
        s = torch.empty(rows, 3 * (n // 32), dtype=torch.int32)
        _check(self.lib.quant_q8_inputs(x.data_ptr(), x.dtype == torch.bfloat16, rows, n, q.data_ptr(), d.data_ptr(),
                                        s.data_ptr()), "quant_q8_inputs")
        return q, d, s

    def matmul(self, qtype: int, blocks: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor,
               rows: int, threads: int = 1) -> None:
        """y [rows, out] = x [rows, in] W^T (any leading shapes of those sizes); x and y float32 or
        bfloat16 (each its own)."""
        rc = self.lib.quant_matmul(qtype, blocks.data_ptr(), blocks.shape[0], in_features, x.data_ptr(),
                                   x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows, threads)
        if rc:
            _check(rc, "quant_matmul")

    def panel_matmul(self, qtype: int, panels: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor,
                     rows: int, threads: int = 1) -> None:
        """As `matmul`, for a weight in the panel layout (`QuantWeight.panelled`)."""
        rc = self.lib.quant_panel_matmul(qtype, panels.data_ptr(), panels.shape[0], in_features, x.data_ptr(),
                                         x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows,
                                         threads)
        if rc:
            _check(rc, "quant_panel_matmul")

    def panel(self, qtype: int, blocks: torch.Tensor, in_features: int, panels: torch.Tensor, back: bool = False,
              threads: int = 1) -> None:
        """panels = blocks regrouped 16 outputs at a time (back: blocks = panels), same shape."""
        _check(self.lib.quant_panel(qtype, blocks.data_ptr(), blocks.shape[0], in_features, panels.data_ptr(),
                                    int(back), threads), "quant_panel")

    def dequantize(self, qtype: int, blocks: torch.Tensor, in_features: int, ids: torch.Tensor | None,
                   y: torch.Tensor, threads: int = 1) -> None:
        """y [n, in] = rows ``ids`` [n] int64 of W (all rows when None), float32 or bfloat16."""
        rc = self.lib.quant_dequantize(qtype, blocks.data_ptr(), blocks.shape[0], in_features,
                                       None if ids is None else ids.data_ptr(), y.shape[0], y.data_ptr(),
                                       y.dtype == torch.bfloat16, threads)
        _check(rc, "quant_dequantize")

    def quantize(self, qtype: int, x: torch.Tensor, out: torch.Tensor, threads: int = 1) -> None:
        """out [rows, row_bytes] uint8 = x [rows, in] (float32 or bfloat16) as Q4_0, Q4_1 or Q8_0."""
        rc = self.lib.quant_quantize(qtype, x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1],
                                     out.data_ptr(), threads)
        _check(rc, "quant_quantize")


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise MemoryError(f"{what} could not allocate its scratch buffer")
    if rc != 0:  # QuantWeight validates first: this is a bug, not bad input
        raise RuntimeError(f"{what} refused its arguments (code {rc})")


Availability = cbuild.Availability  # of QuantKernels: the kernels of one path, or why not


def _bind(lib: ctypes.CDLL, path: Path, isa: str = "") -> QuantKernels:
    lib.metaloom_quant_abi.restype = ctypes.c_int
    if lib.metaloom_quant_abi() != ABI_VERSION:
        raise OSError(f"{path} has ABI {lib.metaloom_quant_abi()}, expected {ABI_VERSION}")
    lib.quant_matmul.argtypes = [_C, _P, _I, _I, _P, _C, _P, _C, _I, _I]
    lib.quant_matmul.restype = ctypes.c_int
    lib.quant_dequantize.argtypes = [_C, _P, _I, _I, _P, _I, _P, _C, _I]
    lib.quant_dequantize.restype = ctypes.c_int
    lib.quant_quantize.argtypes = [_C, _P, _C, _I, _I, _P, _I]
    lib.quant_quantize.restype = ctypes.c_int
    lib.metaloom_quant_openmp.restype = ctypes.c_int
    lib.quant_panel.argtypes = [_C, _P, _I, _I, _P, _C, _I]
    lib.quant_panel.restype = ctypes.c_int
    lib.quant_panel_matmul.argtypes = [_C, _P, _I, _I, _P, _C, _P, _C, _I, _I]
    lib.quant_panel_matmul.restype = ctypes.c_int
    lib.quant_panel_types.restype = ctypes.c_int
    for fn in (lib.quant_matmul_q8, lib.quant_panel_matmul_q8):
        fn.argtypes = [_C, _P, _I, _I, _P, _C, _P, _C, _I, _I]
        fn.restype = ctypes.c_int
    lib.quant_q8_types.restype = ctypes.c_int
    lib.quant_q8_inputs.argtypes = [_P, _C, _I, _I, _P, _P, _P]
    lib.quant_q8_inputs.restype = ctypes.c_int
    return QuantKernels(lib, str(path), bool(lib.metaloom_quant_openmp()), int(lib.quant_panel_types()), isa,
                        int(lib.quant_q8_types()))


# quant.c's QUANT_PARTS: compiled as that many units at once (cbuild.compile_library)
PARTS = int(re.search(r"#define QUANT_PARTS (\d+)", SOURCE.read_text()).group(1))  # type: ignore[union-attr]
LIBRARY = cbuild.KernelLibrary(SOURCE, _bind, parts=PARTS)
build = LIBRARY.build  # (cache_dir, compiler, path): compile (or reuse) and load; a failure is a reason
for_path = LIBRARY.for_path  # one instruction-set path's kernels, loaded once per process
kernels = LIBRARY.current  # the kernels of the path that runs now (metaloom.models.kernels.isa.chosen)


def _threads(nbytes: int) -> int:
    return torch.get_num_threads() if nbytes >= PARALLEL_MIN_BYTES else 1


# ---- the PyTorch fallback: the same values by bit operations -------------------------------------


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of each block b [..., nb, bytes], as float32 [..., nb, 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles [..., 16] -> [..., 32]: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of packed 6-bit scales and mins [..., 12] -> two [..., 8] (ggml's
    get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return scale, mins


# Each: blocks b [rows, nb, bytes] uint8 -> float32 [rows, nb, block elements], with the same
# operations and float32 roundings as gguf's numpy dequantisers.


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * (_nibbles(b[..., 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * _nibbles(b[..., 4:20]).float() + _halves(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 2:6].contiguous().view(torch.int32)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    return _halves(b, 0) * ((_nibbles(b[..., 6:22]).int() | (high << 4)).float() - 16)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32; sub-block 2k / 2k+1: the low / high nibbles of bytes 32k..32k+31."""
    scale, mins = _k_scales(b[..., 4:16])
    d = (_halves(b, 0) * scale.float()).unsqueeze(-1)
    m = (_halves(b, 2) * mins.float()).unsqueeze(-1)
    qs = b[..., 16:144].unflatten(-1, (4, 1, 32))
    q = torch.cat([qs & 15, qs >> 4], dim=-2).flatten(-3, -2).float()  # [..., 8, 32]
    return (d * q - m).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Two halves of 128; quarter c of a half: nibbles of ql | 2 bits of qh << 4, minus 32."""
    ql = b[..., 0:128].unflatten(-1, (2, 1, 64))
    low = torch.cat([ql & 15, ql >> 4], dim=-2).unflatten(-1, (2, 32)).flatten(-3, -2)  # [..., 2, 4, 32]
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [..., 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).flatten(-3).unflatten(-1, (16, 16)).float()
    scale = b[..., 192:208].contiguous().view(torch.int8).float()
    return ((_halves(b, 208) * scale).unsqueeze(-1) * q).flatten(-2)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 4:8].contiguous().view(torch.int32)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    return _halves(b, 0) * (_nibbles(b[..., 8:24]).int() | (high << 4)).float() + _halves(b, 2)


def _shifted(qs: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """qs [..., 1, n] uint8 -> [..., len(shifts), n]: (qs >> shift) & mask for each shift."""
    return (qs >> torch.tensor(shifts, dtype=torch.uint8).view(-1, 1)) & mask


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16: sub-block 8n + 2j + h holds bits 2j of bytes 32n + 16h .. + 15 of qs;
    scale byte: 4-bit scale (low) and min (high), times d and dmin."""
    sc = b[..., 0:16]
    dl = (_halves(b, 80) * (sc & 15).float()).unsqueeze(-1)
    ml = (_halves(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _shifted(b[..., 16:80].unflatten(-1, (2, 1, 32)), [0, 2, 4, 6], 3)  # [..., 2, 4, 32]
    return (dl * q.flatten(-3).unflatten(-1, (16, 16)).float() - ml).flatten(-2)


def _q3_k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of 6-bit scales [..., 12] -> [..., 16] signed (minus 32)."""
    low = _shifted(sc[..., 0:8].unsqueeze(-2), [0, 4], 15).flatten(-2)  # [..., 16]
    high = _shifted(sc[..., 8:12].unsqueeze(-2), [0, 2, 4, 6], 3).flatten(-2)
    return (low | (high << 4)).int() - 32


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """As Q2_K's quants, each with a third bit from hmask (element e: bit e // 32 of byte e % 32);
    a clear bit subtracts 4. Scale d (sc - 32) per sub-block of 16."""
    dl = (_halves(b, 108) * _q3_k_scales(b[..., 96:108]).float()).unsqueeze(-1)
    low = _shifted(b[..., 32:96].unflatten(-1, (2, 1, 32)), [0, 2, 4, 6], 3).flatten(-3)  # [..., 256]
    high = _shifted(b[..., 0:32].unsqueeze(-2), list(range(8)), 1).flatten(-2)
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return (dl * q.unflatten(-1, (16, 16)).float()).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's nibbles (at byte 48) with a 5th bit: sub-block s's from bit s of qh[32]."""
    scale, mins = _k_scales(b[..., 4:16])
    d = (_halves(b, 0) * scale.float()).unsqueeze(-1)
    m = (_halves(b, 2) * mins.float()).unsqueeze(-1)
    low = _shifted(b[..., 48:176].unflatten(-1, (4, 1, 32)), [0, 4], 15).flatten(-3, -2)  # [..., 8, 32]
    high = _shifted(b[..., 16:48].unsqueeze(-2), list(range(8)), 1)  # [..., 8, 32]
    return (d * (low | (high << 4)).float() - m).flatten(-2)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * torch.tensor(IQ4_VALUES, dtype=torch.float32)[_nibbles(b[..., 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32 (16 bytes each, nibbles as IQ4_NL), 6-bit scales: 4 low bits from
    scales_l[4], 2 high from the uint16 scales_h; scale d (ls - 32)."""
    high = (b[..., 2:4].contiguous().view(torch.int16).int() & 0xFFFF) >> torch.arange(0, 16, 2, dtype=torch.int32)
    low = _shifted(b[..., 4:8].unsqueeze(-2), [0, 4], 15).transpose(-1, -2).flatten(-2).int()  # byte s // 2, nibble s % 2
    dl = (_halves(b, 0) * (low | ((high & 3) << 4)).sub(32).float()).unsqueeze(-1)
    q = _nibbles(b[..., 8:136].unflatten(-1, (8, 16))).long()  # [..., 8, 32]
    return (dl * torch.tensor(IQ4_VALUES, dtype=torch.float32)[q]).flatten(-2)


def _raw(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    1: _raw(torch.float16), 2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 10: _q2_k, 11: _q3_k, 12: _q4_k,
    13: _q5_k, 14: _q6_k, 20: _iq4_nl, 23: _iq4_xs, 30: _raw(torch.bfloat16),
}


def dequantize_torch(qtype: int, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """blocks [rows, row_bytes] -> float32 [rows, in] by PyTorch bit operations (the fallback
    when the C kernels cannot be built; the same values)."""
    q = QTYPES[qtype]
    return _DECODERS[qtype](blocks.view(blocks.shape[0], in_features // q.block, q.bytes)).reshape(-1, in_features)


# Types with quant.c's panel layout (16 outputs side by side: see `QuantWeight.panelled`), stated
# bit by bit in `metaloom.models.kernels.panels`
PANEL_TYPES = panels.PANEL_TYPES
PANEL = panels.PANEL
LAYOUTS = ("gguf", "panel")
_panel_sources = panels.panel_sources


def unpanel_numpy(qtype: int, panelled: torch.Tensor, in_features: int) -> torch.Tensor:
    """GGUF blocks [out, row_bytes] from quant.c's panel layout (see `QuantWeight.panelled`), by
    numpy bit moves: what the C kernels' ``quant_panel(back=1)`` gives, for when they are gone."""
    return panels.unpanel_numpy(qtype, panelled, in_features, QTYPES[qtype].block)


# ---- q8 activations (quant_q8.h) --------------------------------------------------------------------

ACTIVATIONS = ("float", "q8")
Q8_TYPES = frozenset(t for t in QTYPES if QTYPES[t].block > 1)  # every quantised type (not F16, BF16)


def q8_inputs_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] (in a multiple of 32) -> (q int8 [rows, in], d float32 [rows, in / 32]) exactly
    as quant_q8.h's ``q8_row`` quantises activations: per 32 inputs d = max|x| / 127, q =
    round(x (1 / d)) half away from zero, in float32 (a block with a NaN or infinity: d NaN, q 0)."""
    v = x.float().unflatten(-1, (-1, 32))
    a = v.abs()
    bad = ~(a <= torch.finfo(torch.float32).max).all(-1)
    d = torch.where(bad, 0.0, a.amax(-1)) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    t = torch.where(bad.unsqueeze(-1), 0.0, v * inv.unsqueeze(-1))
    whole = t.trunc()  # round half away from zero, exactly (t - whole is exact)
    q = (whole + torch.sign(t) * ((t - whole).abs() >= 0.5)).clamp(-127, 127)
    return q.to(torch.int8).flatten(-2), torch.where(bad, torch.nan, d)


# ---- the weight -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A weight [out, in] as GGUF blocks: ``blocks`` uint8 [out, row_bytes] (contiguous, CPU),
    each row one output's blocks along the input; ``qtype`` a ggml type id (see `QTYPES`).

    ``layout="panel"``: the same bytes regrouped 16 outputs at a time (quant.c's panel layout,
    made by `panelled`), which the batch-1 kernels read fastest; the shape is unchanged, and
    `gguf` gives the file's layout back.

    ``activations="q8"``: a call quantises x to int8 per 32 inputs and multiplies with integer
    dot products (quant_q8.h; `with_activations`), for every number of rows: faster for many rows,
    at the cost of the inputs' rounding (docs/engine.md measures it). Quantised types only."""

    qtype: int
    blocks: torch.Tensor
    in_features: int
    layout: str = "gguf"
    activations: str = "float"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidParameter("layout", self.layout, f"one of {list(LAYOUTS)}")
        if self.layout == "panel" and (self.qtype not in PANEL_TYPES or self.blocks.shape[0] % PANEL):
            names = ", ".join(QTYPES[t].name for t in sorted(PANEL_TYPES))
            raise InvalidParameter("layout", self.layout, f"panels hold {names} weights of a multiple of {PANEL} outputs")
        if not isinstance(self.qtype, int):
            raise InvalidParameter("qtype", self.qtype, "a ggml type id (an int; qtype_id converts a name)")
        q = QTYPES[qtype_id(self.qtype)]  # an unknown id is an UnsupportedModel naming the known ones
        if self.activations not in ACTIVATIONS:
            raise InvalidParameter("activations", self.activations, f"one of {list(ACTIVATIONS)}")
        if self.activations == "q8" and self.qtype not in Q8_TYPES:
            raise InvalidParameter("activations", self.activations,
                                   f"float for a {q.name} weight (q8 multiplies quantised weights' integer quants by "
                                   "int8 activations; a float weight has none)")
        b = self.blocks
        if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8:
            raise InvalidParameter("blocks", getattr(b, "dtype", type(b).__name__), "a torch.uint8 tensor of GGUF blocks")
        if b.device.type != "cpu" or not b.is_contiguous():
            raise InvalidParameter("blocks", f"{b.device} contiguous={b.is_contiguous()}", "a contiguous CPU tensor")
        if self.in_features <= 0 or self.in_features % q.block:
            raise InvalidParameter("in_features", self.in_features, f"a positive multiple of {q.block} for {q.name}")
        if b.dim() != 2 or b.shape[0] < 1 or b.shape[1] != q.row_bytes(self.in_features):
            raise InvalidParameter("blocks", tuple(b.shape),
                                   f"[out >= 1, {q.row_bytes(self.in_features)}]: {self.in_features} inputs of {q.name} "
                                   f"are {self.in_features // q.block} blocks of {q.bytes} bytes per row")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in): the dense weight's shape."""
        return self.blocks.shape[0], self.in_features

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def info(self) -> QType:
        return QTYPES[self.qtype]

    def numel(self) -> int:
        return self.blocks.shape[0] * self.in_features

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def __repr__(self) -> str:
        q8 = ", q8 activations" if self.activations == "q8" else ""
        return f"QuantWeight({self.info.name}, shape={self.shape}{', panels' if self.layout == 'panel' else ''}{q8})"

    def with_activations(self, activations: str) -> QuantWeight:
        """This weight multiplying float (``"float"``) or int8-quantised (``"q8"``) activations."""
        return self if activations == self.activations else replace(self, activations=activations)

    def panelled(self) -> QuantWeight:
        """This weight in the panel layout where this machine's kernels have it (every quantised
        type but Q8_0, out a multiple of 16, the kernels built), else itself. Why: in GGUF's layout a block's
        quants lie along the input, and widening them into vector lanes costs more than reading
        them (see quant.c); with 16 outputs in the 16 lanes a 4-bit matvec runs about twice as
        fast per core. A regrouping of the same bytes: nothing is requantised."""
        k = self._kernels()
        if (self.layout == "panel" or k is None or not (k.panel_types >> self.qtype) & 1
                or self.out_features % PANEL or self.in_features % 32):
            return self
        panels = torch.empty_like(self.blocks)
        k.panel(self.qtype, self.blocks, self.in_features, panels, threads=_threads(self.nbytes))
        return QuantWeight(self.qtype, panels, self.in_features, "panel", self.activations)

    def gguf(self) -> QuantWeight:
        """This weight in GGUF's own layout (itself when it already is)."""
        if self.layout == "gguf":
            return self
        k = kernels().kernels
        blocks = torch.empty_like(self.blocks)
        if k is not None:
            k.panel(self.qtype, blocks, self.in_features, self.blocks, back=True, threads=_threads(self.nbytes))
        else:
            blocks = unpanel_numpy(self.qtype, self.blocks, self.in_features)
        return QuantWeight(self.qtype, blocks, self.in_features, activations=self.activations)

    def _kernels(self) -> QuantKernels | None:
        """The C kernels, when built and this weight's shape suits them (looked up per call, so a
        test can take them away)."""
        k = kernels().kernels
        return k if k is not None and self.in_features % QTYPES[self.qtype].kernel_block == 0 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 or bfloat16 -> x W^T [..., out], same dtype (float32 accumulation)."""
        # Per call this is a few microseconds of Python: no reshapes (the kernel takes x's rows
        # through its pointer), one allocation, already in the output's shape.
        if x.dtype not in _FLOATS:
            raise InvalidParameter("x.dtype", x.dtype, "torch.float32 or torch.bfloat16")
        shape = x.shape
        if not shape or shape[-1] != self.in_features or not x.is_cpu:
            raise InvalidParameter("x", f"{tuple(shape)} on {x.device}", f"a CPU tensor [..., {self.in_features}]")
        rows = x.numel() // self.in_features
        if rows == 0:
            return x.new_empty((*shape[:-1], self.blocks.shape[0]))
        if self.activations == "q8":
            return self._call_q8(x, rows)
        if rows > CROSSOVER_ROWS and (self.layout == "gguf" or x.dtype != torch.float32 or rows > PANEL_CROSSOVER_ROWS):
            from metaloom.models.kernels.onednn import bf16_gemm

            if x.dtype == torch.bfloat16 and not bf16_gemm():  # PyTorch's bfloat16 GEMM is 4x slower than float32 here
                return F.linear(x.float(), self.dequantize()).to(x.dtype)
            return F.linear(x, self.dequantize(x.dtype))
        k = self._kernels()
        if k is None:  # float32 products and sums, one rounding to x's dtype: the kernel's arithmetic
            return F.linear(x.float(), self.dequantize()).to(x.dtype)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty((*shape[:-1], self.blocks.shape[0]), dtype=x.dtype)
        threads = torch.get_num_threads() if self.blocks.numel() >= PARALLEL_MIN_BYTES else 1
        # the library's function itself, not the checked wrappers: a decode step makes 100-200
        # of these calls, and each Python layer costs a microsecond of a step of a few ms
        fn = k.lib.quant_panel_matmul if self.layout == "panel" else k.lib.quant_matmul
        rc = fn(self.qtype, self.blocks.data_ptr(), self.blocks.shape[0], self.in_features, x.data_ptr(),
                x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows, threads)
        if rc:
            _check(rc, "quant_panel_matmul" if self.layout == "panel" else "quant_matmul")
        return y

    def _call_q8(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x W^T with x quantised to int8 per 32 inputs: the integer kernels for every row count
        (a long prefill included: its rows' arithmetic is then a one-token step's), or without
        them the same quantised inputs times the dequantised weight in float32."""
        k = self._kernels()
        shape = x.shape
        if k is None or not (k.q8_types >> self.qtype) & 1:
            q, d = q8_inputs_torch(x.reshape(rows, self.in_features))
            xq = (q.float().unflatten(-1, (-1, 32)) * d.unsqueeze(-1)).flatten(-2)
            return F.linear(xq, self.dequantize()).to(x.dtype).reshape(*shape[:-1], self.out_features)
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty((*shape[:-1], self.out_features), dtype=x.dtype)
        fn = k.lib.quant_panel_matmul_q8 if self.layout == "panel" else k.lib.quant_matmul_q8
        rc = fn(self.qtype, self.blocks.data_ptr(), self.out_features, self.in_features, x.data_ptr(),
                x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows, _threads(self.nbytes))
        if rc:
            _check(rc, "quant_matmul_q8")
        return y

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [out, in]: gguf.quants.dequantize's values (exact in float32; bfloat16
        rounds them to nearest even; other dtypes convert from float32)."""
        if self.layout != "gguf":
            return self.gguf().dequantize(dtype)
        k = self._kernels()
        if k is None:
            return dequantize_torch(self.qtype, self.blocks, self.in_features).to(dtype)
        y = torch.empty(self.shape, dtype=dtype if dtype in _FLOATS else torch.float32)
        k.dequantize(self.qtype, self.blocks, self.in_features, None, y, _threads(self.nbytes))
        return y.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` (integers of any shape, each in [0, out)) of the dense weight -> [..., in]:
        an embedding lookup that decodes only the rows asked for."""
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise InvalidParameter("ids.dtype", ids.dtype, "an integer tensor")
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.out_features):
            bad = flat[(flat < 0) | (flat >= self.out_features)][0].item()
            raise InvalidParameter("ids", bad, f"row indices in [0, {self.out_features})")
        if self.layout != "gguf":
            return self.gguf().rows(ids, dtype)
        k = self._kernels()
        if k is None:
            y = dequantize_torch(self.qtype, self.blocks[flat], self.in_features).to(dtype)
        else:
            y = torch.empty(flat.numel(), self.in_features, dtype=dtype if dtype in _FLOATS else torch.float32)
            k.dequantize(self.qtype, self.blocks, self.in_features, flat, y, 1)
            y = y.to(dtype)
        return y.reshape(*ids.shape, self.in_features)

    @classmethod
    def cat(cls, weights: Sequence[QuantWeight]) -> QuantWeight:
        """One weight of all outputs in order (a fused q,k,v or gate,up projection): same type and
        in_features required."""
        if not weights:
            raise InvalidParameter("weights", [], "at least one QuantWeight")
        first = weights[0]
        for w in weights[1:]:
            if (w.qtype, w.in_features) != (first.qtype, first.in_features):
                raise InvalidParameter("weights", f"{w!r} after {first!r}",
                                       "weights of one type and one in_features")
            if w.activations != first.activations:
                raise InvalidParameter("weights", f"{w!r} after {first!r}", "weights of one activations mode")
        if len({w.layout for w in weights}) > 1:  # panels concatenate as panels (whole panels each)
            weights = [w.gguf() for w in weights]
        return cls(first.qtype, torch.cat([w.blocks for w in weights]), first.in_features, weights[0].layout,
                   first.activations)


def quantize(w: torch.Tensor, qtype: int | str) -> QuantWeight:
    """w [out, in] (float32, bfloat16 or float16; in a multiple of 32) -> a `QuantWeight` with
    ggml's reference rounding: bit for bit what gguf.quants.quantize gives (Q4_0, Q4_1, Q8_0 by
    quant.c when it builds; Q5_0 by gguf; F16 and BF16 round to nearest even). The K types have
    no reference quantiser here (an `InvalidParameter`)."""
    t = qtype_id(qtype)
    q = QTYPES[t]
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise InvalidParameter("w", f"{tuple(w.shape)} {w.dtype}", "a floating-point [out, in] tensor")
    if w.shape[0] < 1 or w.shape[1] % q.kernel_block:
        raise InvalidParameter("w.shape", tuple(w.shape), f"[out >= 1, a multiple of 32] for {q.name}")
    if q.name in ("Q4_K", "Q6_K"):
        raise InvalidParameter("qtype", q.name, "Q4_0, Q4_1, Q5_0, Q8_0, F16 or BF16 (no K-type quantiser)")
    w = w.detach().cpu()
    if q.name in ("F16", "BF16"):
        dense = w.to(torch.float16 if q.name == "F16" else torch.bfloat16).contiguous()
        return QuantWeight(t, dense.view(torch.uint8), w.shape[1])
    k = kernels().kernels
    if k is not None and q.name in QUANTIZERS:
        x = (w if w.dtype in _FLOATS else w.float()).contiguous()
        blocks = torch.empty(w.shape[0], q.row_bytes(w.shape[1]), dtype=torch.uint8)
        k.quantize(t, x, blocks, _threads(x.numel()))
        return QuantWeight(t, blocks, w.shape[1])
    import gguf  # the reference, in numpy

    data = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType(t))
    return QuantWeight(t, torch.from_numpy(np.ascontiguousarray(data)), w.shape[1])


def from_gguf(tensor: Any) -> QuantWeight:
    """A 2-D tensor of a `gguf.GGUFReader` (``reader.tensors[i]``) as a `QuantWeight` (its bytes
    copied out of the memory-mapped file)."""
    t = qtype_id(int(tensor.tensor_type))
    shape = [int(n) for n in tensor.shape]  # ggml order: inputs first
    if len(shape) != 2:
        raise InvalidParameter("tensor", f"{tensor.name} of shape {shape}", "a 2-D weight")
    data = np.asarray(tensor.data).view(np.uint8).reshape(shape[1], -1)
    return QuantWeight(t, torch.from_numpy(data.copy()), shape[0])
