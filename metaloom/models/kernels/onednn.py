"""What PyTorch's oneDNN multiplies natively on this CPU. Asked by the quantised weights (which
GEMM takes a large batch, `metaloom.models.kernels.quant`) and by the packed layouts (whether
bfloat16 packs, `metaloom.models.kernels.packed`), so it sits below both."""

from __future__ import annotations

import functools

import torch

from metaloom.models.kernels import isa


def bf16_gemm() -> bool:
    """Whether oneDNN multiplies bfloat16 natively here: it says so, the kernel path is avx512 (a
    path forced lower stands for a CPU without it) or the CPU has AVX-NE-CONVERT, and packing a
    small weight works."""
    path = isa.chosen().name
    return _bf16_gemm(path == "avx512" or "avx_ne_convert" in isa.cpu_features())


@functools.cache
def _bf16_gemm(cpu_has_it: bool) -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if not cpu_has_it or check is None or not check():
        return False
    try:  # checked, not assumed: the reorder is what raised on CPUs without the instructions
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 16)
    except RuntimeError:
        return False
    return True
