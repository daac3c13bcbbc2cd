"""Rotary position embeddings (Su et al. 2021) in the "rotate half" layout transformers uses,
with the frequency scalings of the Llama family."""

from __future__ import annotations

import math
from typing import Any

import torch

from metaloom.errors import UnsupportedModel


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled as the config says."""
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
    raise UnsupportedModel(f"rope scaling type {kind!r}")


def rope_tables(head_dim: int, theta: float, scaling: dict[str, Any] | None, positions: int,
                dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] for the rotate-half layout."""
    inv = inverse_frequencies(head_dim, theta, scaling).float()
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
