"""Quantised self-draft: the target itself with int8 or int4 weight-only linear layers drafts
for the full-precision target (same tokenizer, same training, so drafts are accepted often).

Weights are quantised symmetrically per output channel (int8) or asymmetrically per group of
``group_size`` input columns (int4, gpt-fast's layout) and multiplied by torch's weight-only
CPU kernels: ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` dequantise inside the
matmul, so only the small integer weights are read from memory, the win when decoding is
memory-bound. Activations, norms, RoPE and the KV cache run in ``compute_dtype`` (bfloat16:
those kernels are fastest with bfloat16 activations on this CPU; see the benchmark note in
`metaloom.bench.speculative`). Other devices dequantise on the fly.

`QuantizedLlama` implements `LanguageModel` (its forward mirrors `metaloom.models.llama`), so
`DraftModelDrafter` runs it like any draft model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.cache import StaticKVCache
from metaloom.models.config import LlamaConfig
from metaloom.models.flops import forward_flops
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.models.rope import apply_rope
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


@dataclass(frozen=True)
class QuantLayer:
    attn_norm: torch.Tensor
    qkv: QuantLinear
    o: QuantLinear
    mlp_norm: torch.Tensor
    gate_up: QuantLinear
    down: QuantLinear


class QuantizedLlama:
    """A `LanguageModel` with the weights of a native `LlamaModel`, quantised."""

    def __init__(self, target: LanguageModel, bits: int = 8, *, group_size: int = 64,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        from metaloom.models.llama import LlamaModel

        if not isinstance(target, LlamaModel):
            raise UnsupportedModel(f"quantised self-draft needs the native model, not {type(target).__name__}")
        self.config: LlamaConfig = target.config
        self.bits = bits
        self.dtype = compute_dtype
        self.embed = target.embed.to(compute_dtype)

        def q(w: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
            return quantize_linear(w, bits, compute_dtype, group_size, bias)

        self.layers = [QuantLayer(attn_norm=w.attn_norm.to(compute_dtype), qkv=q(w.qkv, w.qkv_bias), o=q(w.o),
                                  mlp_norm=w.mlp_norm.to(compute_dtype), gate_up=q(w.gate_up), down=q(w.down))
                       for w in target.layers]
        self.norm = target.norm.to(compute_dtype)
        self.lm_head = q(target.lm_head)
        self._cos = target._cos.to(compute_dtype)
        self._sin = target._sin.to(compute_dtype)
        self._window = self.config.sliding_window

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_cache(self, batch: int, capacity: int) -> StaticKVCache:
        c = self.config
        return StaticKVCache(c.num_hidden_layers, batch, c.num_key_value_heads, capacity, c.head_dim, self.dtype, self.device)

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        c = self.config
        return forward_flops(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                             kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                             vocab=c.vocab_size, new_tokens=new_tokens, attended=attended, logit_rows=logit_rows)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (float32); the same computation as `LlamaModel.forward`."""
        if not isinstance(cache, StaticKVCache):
            raise UnsupportedModel(f"QuantizedLlama needs its own cache (new_cache), not {type(cache).__name__}")
        c = self.config
        b, t = tokens.shape
        if valid is None:
            valid = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        cache.reserve(t)
        lengths = cache.lengths
        uniform = bool((lengths == lengths[0]).all()) if b else True
        positions = lengths[:, None] + torch.arange(t, device=tokens.device)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        keys_len = int(lengths.max()) + t
        mask, causal = _mask(positions, keys_len, uniform, self._window)
        x = F.embedding(tokens, self.embed)
        h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for i, w in enumerate(self.layers):
            y = F.rms_norm(x, (c.hidden_size,), w.attn_norm, c.rms_norm_eps)
            q, k, v = w.qkv(y).view(b, t, h + 2 * hk, d).transpose(1, 2).split([h, hk, hk], dim=1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            cache.write(i, k, v, uniform)
            attn = F.scaled_dot_product_attention(q, cache.keys[i][:, :, :keys_len], cache.values[i][:, :, :keys_len],
                                                  attn_mask=mask, is_causal=causal, enable_gqa=hk != h)
            x = x + w.o(attn.transpose(1, 2).reshape(b, t, h * d))
            y = F.rms_norm(x, (c.hidden_size,), w.mlp_norm, c.rms_norm_eps)
            gate, up = w.gate_up(y).chunk(2, dim=-1)
            x = x + w.down(F.silu(gate) * up)
        cache.advance(valid)
        if last_only:
            x = x[torch.arange(b, device=x.device), valid - 1][:, None]
        x = F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)
        return self.lm_head(x).float()


def _mask(positions: torch.Tensor, keys_len: int, uniform: bool, window: int | None) -> tuple[torch.Tensor | None, bool]:
    """As `LlamaModel._mask`: None when SDPA's own cases are exact, else [B, 1, T, S] bool."""
    t = positions.shape[1]
    if uniform and window is None:
        if t == 1:
            return None, False
        if int(positions[0, 0]) == 0:
            return None, True
    k_pos = torch.arange(keys_len, device=positions.device)
    allowed = k_pos[None, None, :] <= positions[:, :, None]
    if window is not None:
        allowed &= k_pos[None, None, :] > positions[:, :, None] - window
    return allowed[:, None], False


def quantized_drafter(target: LanguageModel, bits: int = 8, group_size: int = 64) -> DraftModelDrafter:
    """Self-draft with ``bits`` (8 or 4) weight-only quantisation of ``target``'s weights
    (quantising takes about a second per 100M weights; keep the drafter across calls)."""
    return DraftModelDrafter(QuantizedLlama(target, bits, group_size=group_size), name=f"quantized-int{bits}")
