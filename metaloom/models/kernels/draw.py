"""The inverse-CDF draw in C (`draw.c`): the same token as PyTorch's cumsum + searchsorted,
without the float64 running sum's [B, V] tensors; and each row's top k (`topk`, Token
Recycling's candidates). `search` is what the decode loop and the speculative code pass to
`metaloom.sampling.counter.inverse_cdf` (sampling does not import models); draw.c says why and
how the sums stay the same.

Built on first use like the other kernels (`metaloom.models.kernels.cbuild`); without a compiler
`kernels()` gives a reason and the caller keeps PyTorch's way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import cbuild

SOURCE = Path(__file__).with_name("draw.c")
ABI_VERSION = 3  # must match draw.c
# From this many probabilities in a call, the rows are shared among PyTorch's threads (a
# parallel region costs microseconds; one row of a 49k vocabulary is ~50 us of additions).
PARALLEL_MIN = 1 << 18
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class DrawKernels:
    lib: ctypes.CDLL
    path: str
    isa: str = ""

    def inverse_cdf(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """probs [B, V] float32 (contiguous, CPU), u [B] float64 -> tokens [B] long: the first
        index i of each row with C[i] > u C[V-1], C the running float64 sum in index order;
        V - 1 when there is none."""
        rows, v = probs.shape
        u = u.to(torch.float64).contiguous()
        tokens = torch.empty(rows, dtype=torch.long)
        threads = torch.get_num_threads() if probs.numel() >= PARALLEL_MIN else 1
        rc = self.lib.inverse_cdf(probs.data_ptr(), rows, v, u.data_ptr(), tokens.data_ptr(), threads)
        if rc == -1:
            raise InvalidParameter("probs", tuple(probs.shape), "[B, V] with V >= 1")
        if rc:
            raise MemoryError(f"inverse_cdf: no memory for {rows} rows of {v} probabilities' chunk sums")
        return tokens

    def topk(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """x [B, V] float32 (contiguous, CPU) -> [B, k] long: each row's k largest entries'
        indices, largest first, equal values in index order (NaN never: -1 only where a row
        has fewer than k other entries). torch.topk's wherever a row's values are distinct."""
        rows, v = x.shape
        out = torch.empty(rows, k, dtype=torch.long)
        threads = torch.get_num_threads() if x.numel() >= PARALLEL_MIN else 1
        if self.lib.rows_topk(x.data_ptr(), rows, v, k, out.data_ptr(), threads):
            raise InvalidParameter("k", k, f"in [1, min({v}, {TOPK_MAX})] for rows of {v} entries")
        return out

    def row_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., V] float32 (contiguous, CPU) -> (values [...] float32, indices [...] long): each
        row's maximum (NaN where the row holds one) and the first index of its largest other
        entry (0 in an all-NaN row)."""
        shape, v = x.shape[:-1], x.shape[-1]
        rows = x.numel() // v if v else 0
        # made in their final shape: right after a forward each torch call costs microseconds
        values, index = torch.empty(shape, dtype=torch.float32), torch.empty(shape, dtype=torch.long)
        threads = torch.get_num_threads() if rows * v >= PARALLEL_MIN else 1
        if self.lib.rows_max(x.data_ptr(), rows, v, values.data_ptr(), index.data_ptr(), threads):
            raise InvalidParameter("x", tuple(x.shape), "[..., V] with V >= 1")
        return values, index


TOPK_MAX = 64  # draw.c's


def _bind(lib: ctypes.CDLL, path: Path, isa: str = "") -> DrawKernels:
    lib.metaloom_draw_abi.restype = ctypes.c_int
    if lib.metaloom_draw_abi() != ABI_VERSION:
        raise OSError(f"{path} has ABI {lib.metaloom_draw_abi()}, expected {ABI_VERSION}")
    lib.inverse_cdf.argtypes = [_P, _I, _I, _P, _P, _I]
    lib.inverse_cdf.restype = ctypes.c_int
    lib.rows_topk.argtypes = [_P, _I, _I, _I, _P, _I]
    lib.rows_topk.restype = ctypes.c_int
    lib.rows_max.argtypes = [_P, _I, _I, _P, _P, _I]
    lib.rows_max.restype = ctypes.c_int
    return DrawKernels(lib, str(path), isa)


LIBRARY = cbuild.KernelLibrary(SOURCE, _bind)
kernels = LIBRARY.current  # the kernels of the path that runs now, or why not


def search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """`metaloom.sampling.counter.inverse_cdf`'s ``search``: the C draw of probs [B, V] at u [B]
    on a CPU, or None (another device, no rows or tokens, no compiler) to leave it to PyTorch."""
    if probs.device.type != "cpu" or not probs.shape[0] or not probs.shape[1]:
        return None
    k = kernels().kernels
    return None if k is None else k.inverse_cdf(probs.contiguous(), u)


def topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest entries' indices [B, k] (long, CPU), largest first: the C
    kernel for float32 rows on a CPU (``k`` up to `TOPK_MAX`), torch.topk otherwise."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and 1 <= k <= min(x.shape[1], TOPK_MAX):
        kern = kernels().kernels
        if kern is not None:
            return kern.topk(x.contiguous(), k)
    return x.float().topk(k, dim=-1).indices.cpu()


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(x, dim=-1)``'s (values, indices) for x [..., V]: each row's largest entry and
    the first index holding it. On a CPU, PyTorch's reduction with an index walks the entries one
    at a time (SmolLM2's 49,152 logits: 0.33 ms for the 9 positions of an 8-token verify, 46 us
    for one row, AMD EPYC Zen 4); the C `rows_max` finds both in one vectorised call. Right after
    a forward that matters more than the arithmetic: each call then starts with cold caches, and
    `amax` with the C top-1 (two calls) took 0.11-0.14 ms of a decode step where they take 0.02
    warm. The values are `amax`'s, NaN where a row holds one, as max's are; such a row's index is
    its largest other entry's (max's would be the NaN's): every caller treats a NaN row as one no
    token can be drawn from, whatever its index."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() == 0 or not x.shape[-1] or not x.numel():
        best = x.max(dim=-1)
        return best.values, best.indices
    kern = kernels().kernels
    if kern is None:
        best = x.max(dim=-1)
        return best.values, best.indices
    return kern.row_max(x if x.is_contiguous() else x.contiguous())
