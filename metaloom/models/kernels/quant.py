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
Beside this module: the ggml types (`metaloom.models.kernels.quant_types`), the compiled library
(`metaloom.models.kernels.quant_library`) and the PyTorch fallback
(`metaloom.models.kernels.quant_torch`). `QuantWeight` looks `kernels` up in this module on every
call, so a test that patches ``quant.kernels`` takes the C kernels away from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import panels
from metaloom.models.kernels.quant_library import QuantKernels, check_rc, kernels
from metaloom.models.kernels.quant_torch import dequantize_torch, q8_inputs_torch
from metaloom.models.kernels.quant_types import QTYPES, QType, qtype_id

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
QUANTIZERS = ("Q4_0", "Q4_1", "Q8_0")  # quant.c's; Q5_0, F16 and BF16 by gguf / PyTorch
_FLOATS = (torch.float32, torch.bfloat16)


def _threads(nbytes: int) -> int:
    return torch.get_num_threads() if nbytes >= PARALLEL_MIN_BYTES else 1


# Types with quant.c's panel layout (16 outputs side by side: see `QuantWeight.panelled`), stated
# bit by bit in `metaloom.models.kernels.panels`
PANEL_TYPES = panels.PANEL_TYPES
PANEL = panels.PANEL
LAYOUTS = ("gguf", "panel")
_panel_sources = panels.panel_sources


def unpanel_numpy(qtype: int, panelled: torch.Tensor, in_features: int) -> torch.Tensor:
    """GGUF blocks [out, row_bytes] from quant.c's panel layout (see `QuantWeight.panelled`), by
    numpy bit moves: what the C kernels' ``quant_panel(back=1)`` gives, for when they are gone."""
    if QTYPES[qtype].name == "Q8_0":  # quant_q8_0.h's panels: per block 16 scales, then 8 groups x 16 outputs x 4
        out, nb = panelled.shape[0], in_features // 32
        p = panelled.reshape(out // PANEL, nb, 544)
        scales = p[:, :, :32].reshape(out // PANEL, nb, PANEL, 2)
        quants = p[:, :, 32:].reshape(out // PANEL, nb, 8, PANEL, 4).permute(0, 1, 3, 2, 4).reshape(out // PANEL, nb,
                                                                                                   PANEL, 32)
        return torch.cat([scales, quants], dim=-1).permute(0, 2, 1, 3).reshape(out, nb * 34).contiguous()
    return panels.unpanel_numpy(qtype, panelled, in_features, QTYPES[qtype].block)


# ---- q8 activations (quant_q8.h) --------------------------------------------------------------------

ACTIVATIONS = ("float", "q8")
Q8_0 = next(t for t in QTYPES if QTYPES[t].name == "Q8_0")
Q8_TYPES = frozenset(t for t in QTYPES if QTYPES[t].block > 1)  # every quantised type (not F16, BF16)


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
        q8_panel = self.qtype == Q8_0 and self.activations == "q8"  # quant_q8_0.h's own panels
        if self.layout == "panel" and (not (self.qtype in PANEL_TYPES or q8_panel) or self.blocks.shape[0] % PANEL):
            names = ", ".join(QTYPES[t].name for t in sorted(PANEL_TYPES))
            raise InvalidParameter("layout", self.layout, f"panels hold {names} weights (and Q8_0 under q8 "
                                   f"activations) of a multiple of {PANEL} outputs")
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
        """This weight multiplying float (``"float"``) or int8-quantised (``"q8"``) activations
        (Q8_0 in panels, which only q8 multiplies, goes back to GGUF's layout for float)."""
        if activations == self.activations:
            return self
        if activations == "float" and self.layout == "panel" and self.qtype == Q8_0:
            return replace(self.gguf(), activations=activations)
        return replace(self, activations=activations)

    def panelled(self) -> QuantWeight:
        """This weight in the panel layout where this machine's kernels have it (every quantised
        type but Q8_0, out a multiple of 16, the kernels built; Q8_0 under q8 activations only, in
        panels of its own: quant_q8_0.h), else itself. Why: in GGUF's layout a block's
        quants lie along the input, and widening them into vector lanes costs more than reading
        them (see quant.c); with 16 outputs in the 16 lanes a 4-bit matvec runs about twice as
        fast per core. A regrouping of the same bytes: nothing is requantised."""
        k = self._kernels()
        types = 0 if k is None else k.panel_types | ((1 << Q8_0) if self.activations == "q8" else 0)
        if (self.layout == "panel" or k is None or not (types >> self.qtype) & 1
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
            check_rc(rc, "quant_panel_matmul" if self.layout == "panel" else "quant_matmul")
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
            check_rc(rc, "quant_matmul_q8")
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
        k = self._kernels()
        if self.layout != "gguf" and self.qtype == Q8_0 and k is not None:  # a tied head's panels serve as the table
            y = torch.empty(flat.numel(), self.in_features, dtype=dtype if dtype in _FLOATS else torch.float32)
            k.q8_0_panel_rows(self.blocks, self.in_features, flat, y)
            return y.to(dtype).reshape(*ids.shape, self.in_features)
        if self.layout != "gguf":  # without the kernels a Q8_0 panel weight too (unpanel_numpy reads it)
            return self.gguf().rows(ids, dtype)
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
