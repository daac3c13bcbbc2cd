"""The eager path's attention masks and its attention with soft-capped scores (the PyTorch ops
of `metaloom.models.engine.eager`)."""

from __future__ import annotations

import torch


def tree_mask(lengths: torch.Tensor, tree: torch.Tensor, keys_len: int) -> torch.Tensor:
    """[B, 1, T, S] bool for a token-tree block: every cached key, and the block's keys the
    tree allows (a sliding window is not applied: refused for trees by the caller)."""
    b, t = tree.shape[:2]
    k = torch.arange(keys_len, device=tree.device)[None, :] - lengths[:, None]  # [B, S]: index within the block
    inside = (k >= 0) & (k < t)
    block = tree.gather(2, k.clamp(0, t - 1)[:, None, :].expand(b, t, keys_len))  # [B, T, S]
    return ((k < 0)[:, None, :] | (inside[:, None, :] & block))[:, None]


def causal_mask(positions: torch.Tensor, keys_len: int, uniform: bool,
                window: int | None) -> tuple[torch.Tensor | None, bool]:
    """Boolean mask [B, 1, T, S] (True = attend) for queries at ``positions`` [B, T] in layers
    with ``window``, or (None, is_causal) when SDPA's built-in cases are exact: one new token
    per row at a common length, or a fresh causal prefill."""
    t = positions.shape[1]
    if uniform and window is None:
        start = int(positions[0, 0])
        if t == 1:
            return None, False
        if start == 0:
            return None, True
    k_pos = torch.arange(keys_len, device=positions.device)
    allowed = k_pos[None, None, :] <= positions[:, :, None]
    if window is not None:
        allowed &= k_pos[None, None, :] > positions[:, :, None] - window
    return allowed[:, None], False


def capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores (Gemma 2): softmax(cap tanh(q k^T scale / cap)) V, the
    softmax in float32 as transformers takes it. q [B, H, T, D]; keys, values [B, H_kv, S, D];
    mask [B, 1, T, S] (True = attend). -> [B, H, T, D]"""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)
