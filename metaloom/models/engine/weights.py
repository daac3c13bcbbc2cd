"""The native model's weights: how a linear weight multiplies (plain, packed, quantised, parts of
different types), each layer's weights, and building them from transformers-named tensors of
any family the engine runs (`metaloom.models.engine.config`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from metaloom.errors import NotAModel, UnsupportedModel
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.rope import partial_order
from metaloom.models.kernels.packed import Bf16Linear, PackedLinear


class MatMul(Protocol):
    """A weight that multiplies by itself, x [..., in] -> [..., out] (e.g. the quantised
    `metaloom.models.kernels.quant.QuantWeight`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...  # the parameters it stands for (out x in)


class RowTable(Protocol):
    """An embedding table that is not a plain tensor (quantised blocks): rows looked up by id."""

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...  # ids [...] -> [..., d]

    def numel(self) -> int: ...


Weight = torch.Tensor | MatMul
Embedding = torch.Tensor | RowTable


def embed_tokens(table: Embedding, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tokens [...] -> vectors [..., d] in ``dtype``, a fresh tensor (the residual stream)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(tokens, table)
    return table.rows(tokens, dtype)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    qkv: Weight  # [(H + 2 H_kv) D, d]
    qkv_bias: torch.Tensor | None
    o: Weight  # [d, H D]
    mlp_norm: torch.Tensor
    gate_up: Weight  # [2 I, d]
    down: Weight  # [d, I]
    # the families' extra norms (None: the Llama layer has none); every norm weight is stored as
    # it multiplies, Gemma's (1 + w) already added
    q_norm: torch.Tensor | None = None  # [D]: each query head's RMSNorm before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [d]: on the attention's output before the residual add (Gemma)
    post_mlp_norm: torch.Tensor | None = None  # [d]: on the MLP's output


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in].T (+ bias), by the kernel that is fastest here.

    - a `MatMul` (not a tensor) multiplies by itself: a quantised weight, or a
      `metaloom.models.kernels.packed.PackedLinear` (the CPU default, see `LlamaModel.packed`);
    - a single row goes through `torch.mv`: in bfloat16 the GEMM path is several times slower
      for one row (0.9 vs 20 GB/s, measured), and `mv` over [out, in] is the fastest bfloat16
      kernel here;
    - several rows: `F.linear`.

    Weights stay [out, in] row-major. Stored transposed ([in, out]), one float32 row multiplies
    faster on this CPU (16-22 against 9-14 GB/s), but 2-64 rows (verify, prefill, batches)
    multiply 1.4-2x slower (measured side by side), so the layout was tried and dropped.
    """
    if not isinstance(w, torch.Tensor):
        y = w(x)
        return y if bias is None else y + bias
    if x.numel() == x.shape[-1]:
        y = torch.mv(w, x.reshape(-1)).view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def plain_weight(w: Weight) -> Weight:
    """The plain tensor behind a packed weight; any other weight as it is."""
    return w.weight if isinstance(w, (PackedLinear, Bf16Linear)) else w


def dense_weight(w: Weight) -> torch.Tensor:
    """The plain [out, in] tensor of a plain or packed weight (a quantised one has none)."""
    w = plain_weight(w)
    if not isinstance(w, torch.Tensor):
        raise UnsupportedModel(f"a {type(w).__name__} weight has no plain tensor")
    return w


@dataclass(frozen=True, eq=False)
class Concat:
    """Weights stacked along their outputs that cannot be one tensor: quantised parts of
    different types (a GGUF may keep v in Q8_0 beside q and k in Q5_0). A `MatMul`."""

    parts: tuple[Weight, ...]

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x, p) for p in self.parts], dim=-1)


def panelled(w: Weight) -> Weight:
    """``w`` with its quantised parts in the panel layout where the kernels have one
    (`metaloom.models.kernels.quant.QuantWeight.panelled`); anything else as it is."""
    if isinstance(w, Concat):
        return Concat(tuple(panelled(p) for p in w.parts))
    panel = getattr(w, "panelled", None)
    return panel() if callable(panel) else w


def stack(ws: list[Weight]) -> Weight:
    """One weight whose outputs are ``ws``'s outputs in order (q, k, v into qkv; gate, up)."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat(ws).contiguous()  # type: ignore[arg-type]  # all tensors, checked
    from metaloom.models.kernels.quant import QuantWeight

    if all(isinstance(w, QuantWeight) for w in ws):
        same = {(w.qtype, w.in_features) for w in ws}  # type: ignore[union-attr]
        if len(same) == 1:
            return QuantWeight.cat(ws)  # type: ignore[arg-type]  # all QuantWeights, checked
    return Concat(tuple(ws))


def _rows(w: Weight, order: torch.Tensor) -> Weight:
    """``w`` with its output rows in ``order`` (a quantised weight moves whole rows of blocks)."""
    from metaloom.models.kernels.quant import QuantWeight

    if isinstance(w, torch.Tensor):
        return w[order].contiguous()
    if isinstance(w, QuantWeight):  # rows are outputs: whole rows of blocks move
        g = w.gguf()
        return QuantWeight(g.qtype, g.blocks[order].contiguous(), g.in_features)
    if isinstance(w, Concat):  # q, k, v of different types: the order keeps each part's rows in its part
        starts = [0]
        for part in w.parts:
            starts.append(starts[-1] + part.numel() // _in_features(part))
        return Concat(tuple(_rows(part, order[(order >= lo) & (order < hi)] - lo)
                            for part, lo, hi in zip(w.parts, starts, starts[1:], strict=False)))
    raise UnsupportedModel(f"a {type(w).__name__} weight cannot have its rows reordered (partial RoPE)")


def _in_features(w: Weight) -> int:
    shape = getattr(w, "shape", None)
    return int(shape[1]) if shape is not None else int(getattr(w, "in_features"))  # noqa: B009


def build_layers(config: LlamaConfig, get: Callable[[str], torch.Tensor],
                 weight: Callable[[str], Weight], has: Callable[[str], bool]) -> list[LayerWeights]:
    """Every layer's weights from transformers' names: ``get`` a dense tensor, ``weight`` a
    linear weight (dense or kept quantised), ``has`` whether a name is there. q/k/v and
    gate/up come as three and two tensors (Llama, Qwen, Gemma) or fused (Phi-3's qkv_proj,
    gate_up_proj); Gemma's norms are stored as they multiply, ``norm_offset`` added."""
    c = config
    h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    order = None
    if c.rotary_dim < d:  # partial RoPE: q and k rows in the order that rotates whole heads
        head = partial_order(d, c.rotary_dim)
        order = torch.cat([head + i * d for i in range(h + hk)] + [torch.arange(hk * d) + (h + hk) * d])

    def norm(name: str) -> torch.Tensor:
        w = get(name)
        return w + c.norm_offset if c.norm_offset else w

    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        fused = has(a + "qkv_proj.weight")
        qkv = weight(a + "qkv_proj.weight") if fused else stack([weight(a + f"{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([get(a + f"{n}_proj.bias") for n in "qkv"]) if c.attention_bias else None
        if order is not None:
            qkv = _rows(qkv, order)
            bias = None if bias is None else bias[order]
        gate_up = (weight(p + "mlp.gate_up_proj.weight") if has(p + "mlp.gate_up_proj.weight")
                   else stack([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")]))
        gemma = c.post_norms
        layers.append(LayerWeights(
            attn_norm=norm(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o=weight(a + "o_proj.weight"),
            mlp_norm=norm(p + ("pre_feedforward_layernorm" if gemma else "post_attention_layernorm") + ".weight"),
            gate_up=gate_up,
            down=weight(p + "mlp.down_proj.weight"),
            q_norm=norm(a + "q_norm.weight") if c.qk_norm else None,
            k_norm=norm(a + "k_norm.weight") if c.qk_norm else None,
            post_attn_norm=norm(p + "post_attention_layernorm.weight") if gemma else None,
            post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if gemma else None,
        ))
    return layers


def require(sd: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> Callable[[str], torch.Tensor]:
    """``sd[name]`` in ``dtype`` on ``device``; a missing name is a `NotAModel` naming it."""

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise NotAModel(f"weights are missing tensor {name!r}")
        return sd[name].to(device=device, dtype=dtype)

    return get
