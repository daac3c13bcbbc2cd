"""Rotary position embeddings (Su et al. 2021) in the "rotate half" layout transformers uses,
with the frequency scalings of the families the engine runs: linear, Llama 3's, and LongRoPE
(Ding et al. 2024, Phi-3's "su"), and partial rotation (Phi-4-mini rotates 3/4 of each head).

Partial rotation is folded into the full-width layout: `partial_order` lists a head's
dimensions so that rotate-half over the whole head pairs exactly the rotated ones and leaves
the rest where cos = 1 and sin = 0. The model permutes its q and k weights' rows by it once; q . k
is the same sum in another order, and every kernel keeps rotating whole heads.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from metaloom.errors import UnsupportedModel


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        long: bool = False) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled as the config says (``head_dim``: the
    rotated dimensions). ``long``: LongRoPE's long factors (else its short ones)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, blended, scaled)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        if factors.shape != inv.shape:
            raise UnsupportedModel(f"LongRoPE factors of length {factors.numel()} for {inv.numel()} frequencies")
        return inv / factors
    raise UnsupportedModel(f"rope scaling type {kind!r}")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's sqrt(1 + ln(s) / ln(original context)),
    s the context's growth (transformers' default), or the config's own; 1 elsewhere."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def partial_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[head_dim] the order of a head's dimensions in which rotate-half over the whole head
    rotates only the first ``rotary_dim`` (each half's rotated dims, then its passed-through ones)."""
    hr, hp = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(hr), rotary_dim + torch.arange(hp), hr + torch.arange(hr),
                      rotary_dim + hp + torch.arange(hp)])


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, positions: int,
                dtype: torch.dtype, device: torch.device | str,
                rotary_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] for the rotate-half layout (in `partial_order` when
    ``rotary_dim`` < ``head_dim``: cos 1 and sin 0 on the dimensions not rotated).

    LongRoPE takes its short factors for positions below the original context and its long ones
    from there on: what transformers gives a cached decode that grows past it (it picks the
    factors from the longest position of each forward, so the keys cached before stay as they
    were rotated); an uncached forward longer than the original context rotates every position
    with the long factors there."""
    rot = rotary_dim or head_dim
    pos = torch.arange(positions, dtype=torch.float32)
    inv = inverse_frequencies(rot, theta, scaling).float()
    angles = torch.outer(pos, inv)
    if scaling is not None and scaling.get("rope_type") == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        if positions > original:
            angles[original:] = torch.outer(pos[original:], inverse_frequencies(rot, theta, scaling, long=True).float())
    cos, sin = angles.cos(), angles.sin()
    factor = attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    if rot < head_dim:
        pad = (head_dim - rot) // 2
        cos = torch.cat([cos, torch.ones(positions, pad)], dim=-1)
        sin = torch.cat([sin, torch.zeros(positions, pad)], dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
