"""The static-shape step itself: one decode step (or a speculative verify block) of a dense
`metaloom.models.engine.llama.LlamaModel` as a function of fixed buffers only, which
`metaloom.models.engine.graphs` captures as a CUDA graph per bucket and replays.

Attention reads the pool through the table (paged attention with one-token pages, as on the
CPU): forked rows share their prefix's keys on the GPU too. The query heads of a key-value
head group are laid out as ``g`` query positions of that head, so one scaled-dot-product
attention call with a padding mask serves grouped-query attention without repeating keys.

Two steps: PyTorch ops (`static_step`), and four fused Triton kernels a layer
(`metaloom.models.kernels.gpu_triton`; `static_step` with ``triton=True``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from metaloom.models.engine.pool import KVPool
from metaloom.models.engine.rope import apply_rope

if TYPE_CHECKING:
    from metaloom.models.engine.llama import LlamaModel

MAX_WIDTH = 16  # tokens a row in one static step: 1 (decode) or a speculative verify's pending + drafts
# within the Triton step, one-token rows attend through the paged kernel up to PAGED_ROWS rows
# and gather + SDPA above (the "mixed" step: fused norms, RoPE and SiLU with PyTorch's attention).
# On an H100 (1b shape) the paged kernel was 1.22x PyTorch's step at 1 row and 1.15x at 16, but
# 0.93x at 64, where PyTorch's gather feeds its attention faster than the paged kernel reads
# (docs/results/gpu-decode-h100-run6.json); the mixed step at 64 rows was 1.13x PyTorch's step
# (gpu-decode-h100-run7.json). So the Triton step runs at every bucket
# (`metaloom.models.engine.graphs.TRITON_ROWS`), and METALOOM_TRITON_ROWS lowers that (a
# benchmark's or a different GPU's knob)
PAGED_ROWS = 32


@dataclass(frozen=True)
class Buffers:
    """The static inputs of every bucket's step (a bucket reads the leading [R] / [R, L] part)."""

    tokens: torch.Tensor  # [rows, MAX_WIDTH] long
    positions: torch.Tensor  # [rows] long: each row's length before the step
    slots: torch.Tensor  # [rows, MAX_WIDTH] long
    table: torch.Tensor  # [rows, keys] long
    # a verify block (W > 1): which block tokens each attends (a chain: the lower triangle; a
    # token tree: its ancestors, `metaloom.speculative.tree`) and each token's depth (its RoPE
    # position past the row's length)
    tree: torch.Tensor  # [rows, MAX_WIDTH, MAX_WIDTH] bool
    depths: torch.Tensor  # [rows, MAX_WIDTH] long

    @classmethod
    def empty(cls, rows: int, keys: int, device: torch.device) -> Buffers:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        tree = torch.zeros((rows, MAX_WIDTH, MAX_WIDTH), dtype=torch.bool, device=device)
        return cls(z(rows, MAX_WIDTH), z(rows), z(rows, MAX_WIDTH), z(rows, keys), tree, z(rows, MAX_WIDTH))


def _block(buf: Buffers, rows: int, keys: int, width: int, window: int | None,
           g: int, mask: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A step's geometry: (table positions [R, W], where the new tokens' entries sit in the rows'
    tables; RoPE positions [R, W], the length plus each token's depth; the attention mask [R, 1,
    g W, L], every cached key and the block's keys its tree allows, with the group's g query
    heads as g W queries; None without ``mask``)."""
    device = buf.tokens.device
    start = buf.positions[:rows, None]
    at = start + torch.arange(width, device=device)
    rope = at if width == 1 else start + buf.depths[:rows, :width]
    if not mask:
        return at, rope, None
    k_pos = torch.arange(keys, device=device)
    if width == 1:
        allowed = k_pos[None, None, :] <= at[:, :, None]  # [R, 1, L]
    else:
        index = k_pos[None, None, :] - start[:, :, None]  # [R, 1, L]: a key's place in the block (< 0: cached)
        inside = buf.tree[:rows, :width, :width].gather(2, index.clamp(0, width - 1).expand(rows, width, keys))
        allowed = (index < 0) | ((index < width) & inside)  # [R, W, L]
    if window is not None:  # chains only (trees are refused with a window)
        allowed &= k_pos[None, None, :] > at[:, :, None] - window
    if width == 1:
        return at, rope, allowed[:, None]
    return at, rope, allowed[:, None, None].expand(-1, -1, g, -1, -1).reshape(rows, 1, g * width, keys)


# (buffers, R rows, L keys, W tokens a row) -> (logits [R, W, V], hidden [R, W, d])
Step = Callable[[Buffers, int, int, int], tuple[torch.Tensor, torch.Tensor]]


def _gathered_attention(pool: KVPool, layer: int, table: torch.Tensor, q: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor:
    """Attention over the keys gathered through ``table`` [R, L]: q [R, h, W, D] (rotated) ->
    [R, W, h D]. The query heads of a key-value head group are laid out as g W queries of that
    head, so one call serves grouped-query attention without repeating keys."""
    rows, h, width, d = q.shape
    hk = pool.keys[layer].shape[1]
    ks = pool.keys[layer][table].transpose(1, 2)  # [R, hk, L, D]
    vs = pool.values[layer][table].transpose(1, 2)
    q = q.reshape(rows, hk, h // hk * width, d)
    attn = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)  # [R, hk, g W, D]
    # reshape, not view: on CUDA, SDPA's float32 kernels may return other strides
    return attn.reshape(rows, h, width, d).transpose(1, 2).reshape(rows, width, h * d)


def static_step(m: LlamaModel, pool: KVPool, triton: bool = False) -> Step:
    """The step of a dense `metaloom.models.engine.llama.LlamaModel` over ``pool`` for W new
    tokens a row (W = 1: a decode step; W > 1: a speculative verify, causal within the block),
    as a function of the static buffers: (buffers, R, L, W) -> (logits [R, W, V], hidden
    [R, W, d]). It writes each new key and value at its slot and each slot into the table.
    ``triton``: with the fused kernels of `metaloom.models.kernels.gpu_triton` (the caller
    checked they run here), else PyTorch ops."""
    if triton:
        return _triton_step(m, pool)
    from metaloom.models.engine.llama import embed_tokens, linear

    c = m.config
    h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = h // hk
    window = c.sliding_window

    def step(buf: Buffers, rows: int, keys: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, slots = buf.tokens[:rows, :width], buf.slots[:rows, :width]
        at, rope, mask = _block(buf, rows, keys, width, window, g)
        table = buf.table[:rows, :keys]
        table.scatter_(1, at, slots)  # the new entries' slots, as the host's table has them
        cos = m._cos[rope][:, None]  # [R, 1, W, D]
        sin = m._sin[rope][:, None]
        flat = slots.reshape(-1)
        x = embed_tokens(m.embed, tokens, m.dtype)  # [R, W, d]
        for i, w in enumerate(m.layers):
            y = F.rms_norm(x, (c.hidden_size,), w.attn_norm, c.rms_norm_eps)
            qkv = linear(y, w.qkv, w.qkv_bias).view(rows, width, h + 2 * hk, d).transpose(1, 2)
            qk = apply_rope(qkv[:, :h + hk], cos, sin)  # [R, h + hk, W, D]
            k, v = qk[:, h:], qkv[:, h + hk:]  # [R, hk, W, D]
            pool.keys[i].index_copy_(0, flat, k.transpose(1, 2).reshape(-1, hk, d))
            pool.values[i].index_copy_(0, flat, v.transpose(1, 2).reshape(-1, hk, d))
            attn = _gathered_attention(pool, i, table, qk[:, :h], mask)
            x = x + linear(attn, w.o)
            y = F.rms_norm(x, (c.hidden_size,), w.mlp_norm, c.rms_norm_eps)
            gate, up = linear(y, w.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w.down)
        hidden = F.rms_norm(x, (c.hidden_size,), m.norm, c.rms_norm_eps)
        return linear(hidden, m.lm_head), hidden

    return step


def _triton_step(m: LlamaModel, pool: KVPool) -> Step:
    """`static_step` with four fused kernels a layer (`metaloom.models.kernels.gpu_triton`):
    residual add + RMSNorm, RoPE + KV write, SiLU x up and, for one token a row up to
    `PAGED_ROWS` rows, attention read through the table (a verify block of W > 1, or more rows,
    gathers and uses PyTorch's attention, as the plain step does)."""
    from metaloom.models.engine.llama import embed_tokens, linear
    from metaloom.models.kernels import gpu_triton as gt

    c = m.config
    h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g, eps, window, size = h // hk, c.rms_norm_eps, c.sliding_window, c.hidden_size
    norms = [w.attn_norm for w in m.layers[1:]] + [m.norm]  # the norm after each layer's MLP add

    def step(buf: Buffers, rows: int, keys: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, slots = buf.tokens[:rows, :width], buf.slots[:rows, :width]
        paged = width == 1 and rows <= PAGED_ROWS
        at, rope, mask = _block(buf, rows, keys, width, window, g, mask=not paged)
        table = buf.table[:rows, :keys]
        table.scatter_(1, at, slots)
        n = rows * width
        flat_pos, flat_slots = rope.reshape(-1), slots.reshape(-1)
        x = embed_tokens(m.embed, tokens, m.dtype).reshape(n, size)
        residual, y = gt.add_rms_norm(x, None, m.layers[0].attn_norm, eps)
        for i, w in enumerate(m.layers):
            qkv = linear(y, w.qkv, w.qkv_bias)  # [N, (h + 2 hk) D]
            q = gt.rope_write(qkv, m._cos, m._sin, flat_pos, flat_slots, pool.keys[i], pool.values[i], h, hk)
            if paged:  # one token a row attends its length's keys, its own included
                attn = gt.paged_attend(q, pool.keys[i], pool.values[i], table, at[:, 0] + 1, keys, d ** -0.5, window)
            else:
                attn = _gathered_attention(pool, i, table, q.view(rows, width, h, d).transpose(1, 2),
                                           mask).reshape(n, h * d)
            residual, y = gt.add_rms_norm(residual, linear(attn, w.o), w.mlp_norm, eps)
            down = linear(gt.silu_mul(linear(y, w.gate_up)), w.down)
            residual, y = gt.add_rms_norm(residual, down, norms[i], eps)
        hidden = y.view(rows, width, size)
        return linear(hidden, m.lm_head), hidden

    return step
