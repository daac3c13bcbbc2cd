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


def llama3_scaling_from_factors(factors: list[float], head_dim: int, theta: float,
                                original: int = 8192) -> dict[str, Any]:
    """The ``rope_scaling`` of a Llama 3.x GGUF, recovered from its ``rope_freqs`` tensor.

    llama.cpp's converter stores Llama 3's scaling as per-frequency divisors (1 for high
    frequencies, ``factor`` for low ones, a blend in between) instead of the config's four
    numbers. Only the ratios of (original context, low_freq_factor, high_freq_factor) enter
    the frequencies, so with the original context fixed the two factors follow from a line fit
    of the blend (smooth = original / wavelength - low, over high - low) through the dimensions
    in between; the result is checked to give back every divisor, and anything that does not
    (a file whose factors are not Llama 3's scheme) is refused rather than run with wrong
    positions."""
    f = torch.tensor(factors, dtype=torch.float64)
    base = inverse_frequencies(head_dim, theta, None)
    if f.shape != base.shape:
        raise UnsupportedModel(f"rope_freqs of length {f.numel()} for {base.numel()} frequencies (head_dim {head_dim})")
    if not bool(((f - 1).abs() > 1e-6).any()):
        return {"rope_type": "default"}
    factor = float(f.max())
    medium = ((f - 1).abs() > 1e-6) & ((f - factor).abs() > 1e-6 * factor)
    low, high = 1.0, 4.0  # Llama 3.1/3.2's own, used when fewer than two blended dimensions fix them
    if int(medium.sum()) >= 2:
        # 1 / f = (1 - s) / factor + s  =>  s = (1 / f - 1 / factor) / (1 - 1 / factor), linear in 1 / wavelength
        smooth = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
        x = base[medium] / (2 * math.pi)
        slope, intercept = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), smooth[:, None]).solution[:, 0]
        low = float(f"{float(-intercept * original / slope):.7g}")  # the fit's last bits are noise
        high = float(f"{low + original / float(slope):.7g}")
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": original}
    back = base / inverse_frequencies(head_dim, theta, scaling)
    if not torch.allclose(back, f, rtol=1e-5, atol=0.0):
        raise UnsupportedModel(f"rope_freqs factors that are not Llama 3's scaling (largest mismatch "
                               f"{float((back - f).abs().max()):.3g}): native GGUFs take Llama 3's scheme only")
    return scaling
