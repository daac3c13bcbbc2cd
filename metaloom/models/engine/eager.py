"""The native model's forward in plain PyTorch ops: prefill, blocks of several tokens, token
trees, and every step the fused kernels (`metaloom.models.engine.fused_step`) do not take.
`LlamaModel._hidden` checks the input, reserves the slots and picks the path; this is the one
the fused paths agree with (`tests/test_fused.py`, `tests/test_fused_verify.py`).

At batch 1 on a CPU the per-op overhead is a large share of a forward, so what every layer
shares is made once per forward (`Block`): one attention mask per window, one gather of each
RoPE table at the block's positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from metaloom.models.engine import attention, dropping
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.rope import apply_rope
from metaloom.models.engine.weights import LayerWeights, linear

if TYPE_CHECKING:
    from metaloom.models.engine.llama import LlamaModel


@dataclass(frozen=True)
class Block:
    """What every layer of one forward shares: where the block's tokens sit, what they attend
    and how."""

    device: torch.device  # the tokens'
    entries: torch.Tensor  # [B, T]: where each token sits in its row
    keys_len: int  # keys each row attends: its cached ones and the block's
    fresh: bool  # nothing cached: attend to this forward's keys
    run: int | None  # one row in one run of slots: read in place (`PagedKVCache.run_start`)
    tree: bool  # a token tree: one mask (under None) for every layer
    masks: dict[int | None, tuple[torch.Tensor | None, bool]]  # per window: mask, is_causal
    rope_at: dict[int, tuple[torch.Tensor, torch.Tensor]]  # per table: cos, sin [B, 1, T, D] at positions
    explicit: bool  # attention written out (dropping.attend) instead of SDPA
    sinks: bool  # rows that dropped positions attend their sinks at in-cache positions
    mass: str | None  # attention to record (`dropping.needs_mass`)
    into: torch.Tensor | None  # [B, keys_len] float32: where the recorded attention adds up


def block(model: LlamaModel, tokens: torch.Tensor, cache: PagedKVCache, lengths: torch.Tensor,
          tree: torch.Tensor | None) -> Block:
    """The `Block` of a forward of ``tokens`` [B, T] over rows of ``lengths`` (before it)."""
    c, opts = model.config, model.options
    b, t = tokens.shape
    uniform = bool((lengths == lengths[0]).all()) if b else True
    fresh = uniform and (not b or int(lengths[0]) == 0)  # nothing cached: attend to this forward's keys
    entries = lengths[:, None] + torch.arange(t, device=tokens.device)  # [B, T]: where each token sits in its row
    # its position: the entry plus the positions the row dropped (--kv-policy), which RoPE sees
    positions = entries + torch.from_numpy(cache.shift).to(tokens.device)[:, None] if cache.drops else entries
    keys_len = int(lengths.max()) + t
    explicit_scores = c.attn_softcap is not None  # SDPA has no soft-capping: the scores written out
    masks: dict[int | None, tuple[torch.Tensor | None, bool]] = {}
    if tree is not None:  # a token tree: each token one past its parent, attending its ancestors
        positions = lengths[:, None] + tree.sum(-1) - 1
        masks[None] = (attention.tree_mask(lengths, tree, keys_len), False)
    else:
        for window in dict.fromkeys(model.windows):
            masks[window] = attention.causal_mask(entries, keys_len, uniform and not explicit_scores, window)
    run = None if fresh else cache.run_start(keys_len)  # one row in one run of slots: read in place
    # rows that dropped positions with sinks (StreamingLLM), or attention to record (H2O,
    # SnapKV's prompt): attention written out (dropping.attend) instead of SDPA
    mass = dropping.needs_mass(opts, t) if opts.drops else None
    sinks = bool(cache.sinks.any()) and cache.drops
    explicit = mass is not None or sinks
    into = torch.zeros(b, keys_len, dtype=torch.float32, device=tokens.device) if explicit and mass else None
    rope_at: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per table: cos, sin [B, 1, T, D] at positions
    for cos, sin in model.ropes:
        rope_at.setdefault(id(cos), (cos[positions][:, None], sin[positions][:, None]))
    return Block(tokens.device, entries, keys_len, fresh, run, tree is not None, masks, rope_at, explicit, sinks,
                 mass, into)


def forward(model: LlamaModel, tokens: torch.Tensor, cache: PagedKVCache, lengths: torch.Tensor,
            slots: torch.Tensor, valid: torch.Tensor, tree: torch.Tensor | None, last_only: bool) -> torch.Tensor:
    """The transformer up to and including the final norm, [B, T, d] (or [B, 1, d]), for
    ``tokens`` [B, T] written at ``slots`` [B, T] (from `PagedKVCache.prepare`) into rows that
    held ``lengths`` before; advances the cache by ``valid``."""
    c, opts = model.config, model.options
    blk = block(model, tokens, cache, lengths, tree)
    x = model.embed_rows(tokens)  # [B, T, d]
    for i, w in enumerate(model.layers):
        x = layer(model, i, w, x, cache, slots, valid, blk)
    cache.advance(valid)
    if opts.drops:
        votes = None
        if blk.mass == "all":
            cache.attention_mass()[:, :blk.keys_len] += blk.into.cpu().double().numpy()  # type: ignore[union-attr]
        elif blk.mass == "window":
            votes = blk.into.cpu().double().numpy()  # type: ignore[union-attr]
        dropping.after_forward(opts, cache, tokens.shape[1], votes)
    if last_only:
        x = x[torch.arange(x.shape[0], device=x.device), valid - 1][:, None]
    return F.rms_norm(x, (c.hidden_size,), model.norm, c.rms_norm_eps)


def layer(model: LlamaModel, i: int, w: LayerWeights, x: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor,
          valid: torch.Tensor, blk: Block) -> torch.Tensor:
    """Layer ``i`` (weights ``w``) on the residual stream ``x`` [B, T, d]: its keys and values
    written into the cache, the stream after its attention and MLP returned."""
    c = model.config
    b, t = x.shape[:2]
    h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    y = F.rms_norm(x, (c.hidden_size,), w.attn_norm, c.rms_norm_eps)
    qkv = linear(y, w.qkv, w.qkv_bias).view(b, t, h + 2 * hk, d).transpose(1, 2)
    qk = qkv[:, :h + hk]
    if w.q_norm is not None and w.k_norm is not None:  # Qwen3, Gemma 3: each head normed before RoPE
        qk = torch.cat([F.rms_norm(qk[:, :h], (d,), w.q_norm, c.rms_norm_eps),
                        F.rms_norm(qk[:, h:], (d,), w.k_norm, c.rms_norm_eps)], dim=1)
    cos, sin = blk.rope_at[id(model.ropes[i][0])]
    # one RoPE call for q and k together (half the small ops of two calls)
    q, k = apply_rope(qk, cos, sin).split([h, hk], dim=1)  # [B, heads, T, D]
    v = qkv[:, h + hk:]
    cache.write(i, k, v, slots)
    keys, values = (k, v) if blk.fresh else cache.gather(i, blk.keys_len, blk.run)
    mask, causal = blk.masks[None if blk.tree else model.windows[i]]
    if blk.explicit:
        table = model.ropes[i]
        q_in = apply_rope(qk[:, :h], table[0][blk.entries][:, None], table[1][blk.entries][:, None]) if blk.sinks else None
        attn = dropping.attend(q, q_in, keys, values, blk.entries, torch.from_numpy(cache.sinks).to(blk.device),
                               valid, blk.mass, blk.into)
    elif c.attn_softcap is not None:  # SDPA has no soft-capping: the scores written out
        attn = attention.capped_attention(q, keys, values, mask, c.attention_scale, c.attn_softcap)
    else:
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                              enable_gqa=hk != h, scale=c.attention_scale)
    out = linear(attn.transpose(1, 2).reshape(b, t, h * d), w.o)
    if w.post_attn_norm is not None:
        out = F.rms_norm(out, (c.hidden_size,), w.post_attn_norm, c.rms_norm_eps)
    x = x + out
    y = F.rms_norm(x, (c.hidden_size,), w.mlp_norm, c.rms_norm_eps)
    gate, up = linear(y, w.gate_up).chunk(2, dim=-1)
    gated = F.silu(gate) if c.activation == "silu" else F.gelu(gate, approximate="tanh")
    out = linear(gated * up, w.down)
    if w.post_mlp_norm is not None:
        out = F.rms_norm(out, (c.hidden_size,), w.post_mlp_norm, c.rms_norm_eps)
    return x + out
