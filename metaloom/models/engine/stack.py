"""Every layer of a one-token decode step in one C call (`fused.c`'s ``decode_layers``), for a
model whose linear weights are all ones the quantised kernels multiply.

Why: a batch-1 step of SmolLM2-135M is 30 layers x (3 fused kernels + 4 matmuls). Driven from
Python, each of those ~210 calls costs several microseconds besides its work (ctypes argument
conversion, an output tensor, the model's loop); on an AVX2 Zen 3 that was about a third of a
step (3.3 of ~9 ms, measured by replacing every kernel with a no-op). ``decode_layers`` runs the
same kernels, in the same order, on the same buffers as `LlamaModel._step_fused`'s loop, so its
results are the same bits (tests/test_stack.py); the quantised matmuls are reached through
function pointers into quant.c's library, which the plan (`plan`) holds per layer beside each
weight's blocks, type and shape.

A plan is made once per model and quantised-kernel library (each instruction-set path has its
own), and applies when every layer's q/k/v, o, gate/up and down weight is a `QuantWeight` (any
type, GGUF or panel layout), a `Bf16Linear` whose inputs the kernels can walk, or a `Concat` of up
to three such parts (q, k, v of different types); otherwise the model keeps its Python loop.
The step's rows must be at most `metaloom.models.kernels.quant.CROSSOVER_ROWS` (the Python loop's
`QuantWeight` calls hand larger batches to a dense GEMM instead).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from metaloom.models.kernels.quant import PARALLEL_MIN_BYTES, QuantWeight
from metaloom.models.kernels.quant_library import QuantKernels
from metaloom.models.kernels.quant_types import QTYPES

MAX_PARTS = 3  # fused.c's: q, k and v of three types


class PartDesc(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("w", ctypes.c_void_p), ("type", ctypes.c_int64), ("out", ctypes.c_int64),
                ("in_", ctypes.c_int64), ("parallel", ctypes.c_int64)]


class WeightDesc(ctypes.Structure):
    _fields_ = [("part", PartDesc * MAX_PARTS), ("parts", ctypes.c_int64), ("out", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", WeightDesc), ("o", WeightDesc),
                ("gate_up", WeightDesc), ("down", WeightDesc), ("cs", ctypes.c_void_p), ("sn", ctypes.c_void_p),
                ("window", ctypes.c_int64), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("post_attn", ctypes.c_void_p), ("post_mlp", ctypes.c_void_p)]


@dataclass(frozen=True, eq=False)
class Plan:
    """The layers' descriptors for one quantised-kernel library; ``keep`` holds every tensor whose
    memory they point into (the model holds them too: this is belt and braces)."""

    layers: Any  # ctypes array of LayerDesc
    count: int
    keep: tuple[torch.Tensor, ...]


def _blocks(w: object) -> QuantWeight | None:
    from metaloom.models.kernels.packed import Bf16Linear

    q = w.blocks if isinstance(w, Bf16Linear) else w
    if not isinstance(q, QuantWeight) or q.in_features % QTYPES[q.qtype].kernel_block:
        return None
    return q


def plan(layers: list[Any], kernels: QuantKernels, dtype: torch.dtype,
         ropes: list[tuple[torch.Tensor, torch.Tensor]], windows: list[int | None]) -> Plan | None:
    """Descriptors of ``layers`` (`metaloom.models.engine.weights.LayerWeights`) for ``kernels``, or
    None where a weight is not one the kernels multiply (the model keeps its Python loop). Layer
    i rotates by ``ropes[i]`` (cos, sin) and slides over ``windows[i]`` positions (None: none);
    its optional norms (per-head q/k, post-attention, post-MLP) are NULL where it has none."""
    keep: list[torch.Tensor] = []
    lib = kernels.lib  # each weight's kernel by its layout and activations (q8: quant_q8.h's)
    fns = {("panel", "float"): lib.quant_panel_matmul, ("gguf", "float"): lib.quant_matmul,
           ("panel", "q8"): lib.quant_panel_matmul_q8, ("gguf", "q8"): lib.quant_matmul_q8}

    def weight(w: object, bias: torch.Tensor | None = None) -> WeightDesc | None:
        from metaloom.models.engine.weights import Concat

        blocks = [_blocks(p) for p in (w.parts if isinstance(w, Concat) else (w,))]
        if not 1 <= len(blocks) <= MAX_PARTS or any(q is None for q in blocks):
            return None
        parts = (PartDesc * MAX_PARTS)()
        for i, q in enumerate(blocks):
            assert q is not None  # checked above
            keep.append(q.blocks)
            fn = ctypes.cast(fns[q.layout, q.activations], ctypes.c_void_p).value
            parts[i] = PartDesc(fn, q.blocks.data_ptr(), q.qtype, q.out_features, q.in_features,
                                int(q.nbytes >= PARALLEL_MIN_BYTES))
        if bias is not None:
            bias = bias.to(dtype).contiguous()
            keep.append(bias)
        return WeightDesc(parts, len(blocks), sum(q.out_features for q in blocks if q is not None),
                          None if bias is None else bias.data_ptr())

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    descs = []
    for layer, (cos, sin), window in zip(layers, ropes, windows, strict=True):
        parts = [weight(layer.qkv, layer.qkv_bias), weight(layer.o), weight(layer.gate_up), weight(layer.down)]
        norms = [n for n in (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.post_attn_norm,
                             layer.post_mlp_norm) if n is not None]
        if any(p is None for p in parts) or any(n.dtype != dtype or not n.is_contiguous() for n in norms):
            return None
        keep += [*norms, cos, sin]
        descs.append(LayerDesc(layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr(), *parts, cos.data_ptr(),
                               sin.data_ptr(), window or 0, ptr(layer.q_norm), ptr(layer.k_norm),
                               ptr(layer.post_attn_norm), ptr(layer.post_mlp_norm)))
    return Plan((LayerDesc * len(descs))(*descs), len(descs), tuple(keep))


def pointers(tensors: list[torch.Tensor]) -> Any:
    """A C array of the tensors' data pointers (the KV pool's per-layer keys or values, which the
    pool may have reallocated since the last step)."""
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
