"""int8 keys and values for the KV pool (`metaloom.models.engine.cache`, ``--kv-dtype int8``).

Each stored vector (one token's key or value for one kv head, [D]) becomes D int8 codes and
one float32 scale: symmetric absmax quantisation, ``scale = max|x| / 127``, ``q = round(x /
scale)`` clamped to [-127, 127] (-128 is never used, so the codes are symmetric about 0),
``x ≈ q * scale``. Rounding is round-half-to-even (`torch.round`), the same rounding the fused
kernels use for the key they write themselves (`metaloom.models.kernels.fused`), so both paths
store the same codes for the same key. Every element comes back within ``scale / 2`` of what
was written (plus the float rounding of one division and one product).

Why per token and per head, not per channel (KIVI, Liu et al. 2024, quantises keys per
channel because their outliers sit in a few channels): a per-token scale lets a slot be
written once, when its token is computed, and read by every row that shares it; a per-channel
scale spans many tokens and would have to be fixed before they exist. At 8 bits the per-token
error is already small against the attention's own rounding (tests/test_kv_int8.py bounds it).

The memory: D + 4 bytes a vector against 4 D (float32) or 2 D (bfloat16): for head_dim 64,
68 bytes against 256 or 128, 3.8x and 1.9x less.
"""

from __future__ import annotations

import torch

QMAX = 127  # codes in [-QMAX, QMAX]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] int8, scales [...] float32), per vector
    along the last dimension. An all-zero vector gets scale 0 and codes 0 (never a NaN)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    # a zero vector divides by 1 instead of 0: its codes are round(0 / 1) = 0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] int8, scales [...] float32 -> codes * scale [..., D] in ``dtype`` (the
    product taken in float32, then rounded once to ``dtype``)."""
    return (codes.float() * scales[..., None]).to(dtype)
