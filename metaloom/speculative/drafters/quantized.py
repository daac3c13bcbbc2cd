"""Quantised self-draft: the target itself with int8 or int4 weight-only linear layers drafts
for the full-precision target (same tokenizer, same training, so drafts are accepted often).

Weights are quantised symmetrically per output channel (int8) or asymmetrically per group of
``group_size`` input columns (int4, gpt-fast's layout) and multiplied by torch's weight-only
CPU kernels: ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` dequantise inside the
matmul, so only the small integer weights are read from memory, the win when decoding is
memory-bound. Activations, norms, RoPE and the KV cache run in ``compute_dtype`` (bfloat16:
those kernels are fastest with bfloat16 activations on this CPU; see the benchmark note in
`metaloom.bench.speculative`). Other devices dequantise on the fly.

`QuantizedLlama` is a `LlamaModel` whose linear layers are `QuantLinear`s (the same forward), so
`DraftModelDrafter` runs it like any draft model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.fused import unsupported_reason
from metaloom.models.llama import LayerWeights, LlamaModel, Weight, plain_weight
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.speculative.drafters.draft_model import DraftModelDrafter

BITS = (8, 4)


@dataclass(frozen=True)
class QuantLinear:
    """y = x @ dequant(weight).T (+ bias). int8: ``weight`` [out, in] int8, ``scales`` [out];
    int4: ``weight`` packed by `_convert_weight_to_int4pack_for_cpu`, ``scales`` [in/g, out, 2]
    (scale, zero) with w = (q - 8) * scale + zero."""

    bits: int
    weight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    group_size: int = 0
    bias: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # dequantised weight, for devices without the packed kernels

    def numel(self) -> int:
        """The parameters it stands for (out x in)."""
        if self.dense is not None:
            return self.dense.numel()
        return self.out_features * (self.weight.shape[1] if self.bits == 8 else self.scales.shape[0] * self.group_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.dense is not None:
            y = flat @ self.dense.T
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_linear(w: torch.Tensor, bits: int, dtype: torch.dtype, group_size: int = 64,
                    bias: torch.Tensor | None = None) -> QuantLinear:
    """Quantise a [out, in] weight. int8: per output channel, symmetric; int4: per group of
    ``group_size`` input columns, asymmetric (min/max)."""
    if bits not in BITS:
        raise InvalidParameter("bits", bits, f"one of {list(BITS)}")
    w = w.float()
    out, inp = w.shape
    b = None if bias is None else bias.to(dtype)
    if bits == 8:
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        if w.device.type != "cpu":
            return QuantLinear(8, q, scales.to(dtype), out, bias=b, dense=(q.to(dtype) * scales.to(dtype)[:, None]))
        return QuantLinear(8, q.contiguous(), scales.to(dtype), out, bias=b)
    if inp % group_size:
        raise UnsupportedModel(f"int4 needs input widths divisible by the group size {group_size}; got {inp}")
    g = w.reshape(out, inp // group_size, group_size)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = lo + 8 * scales
    q = torch.round((g - lo) / scales).clamp(0, 15)
    if w.device.type != "cpu":
        dense = ((q - 8) * scales + zeros).reshape(out, inp).to(dtype)
        return QuantLinear(4, q.to(torch.uint8), scales, out, group_size, b, dense)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out, inp).to(torch.int32), 1)
    sz = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [in/g, out, 2]
    return QuantLinear(4, packed, sz, out, group_size, b)


class QuantizedLlama(LlamaModel):
    """A native `LlamaModel` whose linear layers are the target's, quantised (`QuantLinear`):
    the same forward (`LlamaModel.forward` multiplies by a `QuantLinear` through
    `metaloom.models.llama.linear`), with embedding, norms, RoPE and KV cache in
    ``compute_dtype``. Logits come back in float32."""

    def __init__(self, target: LanguageModel, bits: int = 8, *, group_size: int = 64,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        if not isinstance(target, LlamaModel):
            raise UnsupportedModel(f"quantised self-draft needs the native model, not {type(target).__name__}")

        def q(w: Weight, bias: torch.Tensor | None = None) -> QuantLinear:
            w = plain_weight(w)
            if not isinstance(w, torch.Tensor):
                raise UnsupportedModel(f"the target's weights are already quantised ({type(w).__name__})")
            return quantize_linear(w, bits, compute_dtype, group_size, bias)

        # the target's fused step kernels, where they take the compute dtype
        fused = target.fused if unsupported_reason(target.config, compute_dtype, target.device) is None else None
        layers = [LayerWeights(attn_norm=w.attn_norm.to(compute_dtype), qkv=q(w.qkv, w.qkv_bias), qkv_bias=None,
                               o=q(w.o), mlp_norm=w.mlp_norm.to(compute_dtype), gate_up=q(w.gate_up), down=q(w.down))
                  for w in target.layers]
        super().__init__(target.config, target.embed.to(compute_dtype), layers, target.norm.to(compute_dtype),
                         q(target.lm_head), fused)
        self.bits = bits

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        return super().forward(tokens, cache, valid=valid, last_only=last_only).float()


def quantized_drafter(target: LanguageModel, bits: int = 8, group_size: int = 64) -> DraftModelDrafter:
    """Self-draft with ``bits`` (8 or 4) weight-only quantisation of ``target``'s weights
    (quantising takes about a second per 100M weights; keep the drafter across calls)."""
    return DraftModelDrafter(QuantizedLlama(target, bits, group_size=group_size), name=f"quantized-int{bits}")
