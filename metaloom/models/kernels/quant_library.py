"""The compiled quant.c (`metaloom.models.kernels.quant`'s kernels): its functions' ctypes
signatures, thin checked wrappers (`QuantKernels`) and the build, once per instruction-set path
(`metaloom.models.kernels.cbuild`), into ``~/.cache/metaloom/kernels/<hash>/quant.so``."""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from metaloom.models.kernels import cbuild

SOURCE = Path(__file__).with_name("quant.c")
ABI_VERSION = 4  # must match quant.c
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


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
            check_rc(rc, "quant_matmul_q8")

    def q8_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [rows, in] (float32 or bfloat16, contiguous) as the q8 kernels quantise it: int8 quants
        [rows, in], float32 scales [rows, in / 32], int32 sums [rows, 3 in / 32] (per 32, then per 16)."""
        rows, n = x.shape
        q = torch.empty(rows, n, dtype=torch.int8)
        d = torch.empty(rows, n // 32)
        s = torch.empty(rows, 3 * (n // 32), dtype=torch.int32)
        check_rc(self.lib.quant_q8_inputs(x.data_ptr(), x.dtype == torch.bfloat16, rows, n, q.data_ptr(),
                                          d.data_ptr(), s.data_ptr()), "quant_q8_inputs")
        return q, d, s

    def matmul(self, qtype: int, blocks: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor,
               rows: int, threads: int = 1) -> None:
        """y [rows, out] = x [rows, in] W^T (any leading shapes of those sizes); x and y float32 or
        bfloat16 (each its own)."""
        rc = self.lib.quant_matmul(qtype, blocks.data_ptr(), blocks.shape[0], in_features, x.data_ptr(),
                                   x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows, threads)
        if rc:
            check_rc(rc, "quant_matmul")

    def panel_matmul(self, qtype: int, panels: torch.Tensor, in_features: int, x: torch.Tensor, y: torch.Tensor,
                     rows: int, threads: int = 1) -> None:
        """As `matmul`, for a weight in the panel layout (`QuantWeight.panelled`)."""
        rc = self.lib.quant_panel_matmul(qtype, panels.data_ptr(), panels.shape[0], in_features, x.data_ptr(),
                                         x.dtype == torch.bfloat16, y.data_ptr(), y.dtype == torch.bfloat16, rows,
                                         threads)
        if rc:
            check_rc(rc, "quant_panel_matmul")

    def panel(self, qtype: int, blocks: torch.Tensor, in_features: int, panels: torch.Tensor, back: bool = False,
              threads: int = 1) -> None:
        """panels = blocks regrouped 16 outputs at a time (back: blocks = panels), same shape."""
        check_rc(self.lib.quant_panel(qtype, blocks.data_ptr(), blocks.shape[0], in_features, panels.data_ptr(),
                                      int(back), threads), "quant_panel")

    def dequantize(self, qtype: int, blocks: torch.Tensor, in_features: int, ids: torch.Tensor | None,
                   y: torch.Tensor, threads: int = 1) -> None:
        """y [n, in] = rows ``ids`` [n] int64 of W (all rows when None), float32 or bfloat16."""
        rc = self.lib.quant_dequantize(qtype, blocks.data_ptr(), blocks.shape[0], in_features,
                                       None if ids is None else ids.data_ptr(), y.shape[0], y.data_ptr(),
                                       y.dtype == torch.bfloat16, threads)
        check_rc(rc, "quant_dequantize")

    def q8_0_panel_rows(self, panels: torch.Tensor, in_features: int, ids: torch.Tensor, y: torch.Tensor) -> None:
        """y [n, in] = rows ``ids`` [n] int64 of a Q8_0 weight in quant_q8_0.h's panels, float32 or bfloat16."""
        check_rc(self.lib.quant_q8_0_panel_rows(panels.data_ptr(), panels.shape[0], in_features, ids.data_ptr(),
                                                ids.shape[0], y.data_ptr(), y.dtype == torch.bfloat16),
                 "quant_q8_0_panel_rows")

    def quantize(self, qtype: int, x: torch.Tensor, out: torch.Tensor, threads: int = 1) -> None:
        """out [rows, row_bytes] uint8 = x [rows, in] (float32 or bfloat16) as Q4_0, Q4_1 or Q8_0."""
        rc = self.lib.quant_quantize(qtype, x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], x.shape[1],
                                     out.data_ptr(), threads)
        check_rc(rc, "quant_quantize")


def check_rc(rc: int, what: str) -> None:
    """Raise for a kernel's nonzero return code ``rc`` (of the function named ``what``)."""
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
    lib.quant_q8_0_panel_rows.argtypes = [_P, _I, _I, _P, _I, _P, _C]
    lib.quant_q8_0_panel_rows.restype = ctypes.c_int
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
