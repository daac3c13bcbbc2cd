"""The PyTorch fallback of the quantised kernels (`metaloom.models.kernels.quant`): the same
values by bit operations, for when quant.c cannot be built, and the reference the tests hold the
C kernels to (GGUF blocks -> float32, float activations -> quant_q8.h's int8 inputs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from metaloom.models.kernels.quant_types import QTYPES


def _halves(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of each block b [..., nb, bytes], as float32 [..., nb, 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles [..., 16] -> [..., 32]: low nibbles are elements 0..15, high 16..31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes of packed 6-bit scales and mins [..., 12] -> two [..., 8] (ggml's
    get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], dim=-1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return scale, mins


# Each: blocks b [rows, nb, bytes] uint8 -> float32 [rows, nb, block elements], with the same
# operations and float32 roundings as gguf's numpy dequantisers.


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * (_nibbles(b[..., 2:18]).float() - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * _nibbles(b[..., 4:20]).float() + _halves(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 2:6].contiguous().view(torch.int32)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    return _halves(b, 0) * ((_nibbles(b[..., 6:22]).int() | (high << 4)).float() - 16)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32; sub-block 2k / 2k+1: the low / high nibbles of bytes 32k..32k+31."""
    scale, mins = _k_scales(b[..., 4:16])
    d = (_halves(b, 0) * scale.float()).unsqueeze(-1)
    m = (_halves(b, 2) * mins.float()).unsqueeze(-1)
    qs = b[..., 16:144].unflatten(-1, (4, 1, 32))
    q = torch.cat([qs & 15, qs >> 4], dim=-2).flatten(-3, -2).float()  # [..., 8, 32]
    return (d * q - m).flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """Two halves of 128; quarter c of a half: nibbles of ql | 2 bits of qh << 4, minus 32."""
    ql = b[..., 0:128].unflatten(-1, (2, 1, 64))
    low = torch.cat([ql & 15, ql >> 4], dim=-2).unflatten(-1, (2, 32)).flatten(-3, -2)  # [..., 2, 4, 32]
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [..., 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).flatten(-3).unflatten(-1, (16, 16)).float()
    scale = b[..., 192:208].contiguous().view(torch.int8).float()
    return ((_halves(b, 208) * scale).unsqueeze(-1) * q).flatten(-2)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 4:8].contiguous().view(torch.int32)
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1
    return _halves(b, 0) * (_nibbles(b[..., 8:24]).int() | (high << 4)).float() + _halves(b, 2)


def _shifted(qs: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """qs [..., 1, n] uint8 -> [..., len(shifts), n]: (qs >> shift) & mask for each shift."""
    return (qs >> torch.tensor(shifts, dtype=torch.uint8).view(-1, 1)) & mask


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 sub-blocks of 16: sub-block 8n + 2j + h holds bits 2j of bytes 32n + 16h .. + 15 of qs;
    scale byte: 4-bit scale (low) and min (high), times d and dmin."""
    sc = b[..., 0:16]
    dl = (_halves(b, 80) * (sc & 15).float()).unsqueeze(-1)
    ml = (_halves(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = _shifted(b[..., 16:80].unflatten(-1, (2, 1, 32)), [0, 2, 4, 6], 3)  # [..., 2, 4, 32]
    return (dl * q.flatten(-3).unflatten(-1, (16, 16)).float() - ml).flatten(-2)


def _q3_k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of 6-bit scales [..., 12] -> [..., 16] signed (minus 32)."""
    low = _shifted(sc[..., 0:8].unsqueeze(-2), [0, 4], 15).flatten(-2)  # [..., 16]
    high = _shifted(sc[..., 8:12].unsqueeze(-2), [0, 2, 4, 6], 3).flatten(-2)
    return (low | (high << 4)).int() - 32


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """As Q2_K's quants, each with a third bit from hmask (element e: bit e // 32 of byte e % 32);
    a clear bit subtracts 4. Scale d (sc - 32) per sub-block of 16."""
    dl = (_halves(b, 108) * _q3_k_scales(b[..., 96:108]).float()).unsqueeze(-1)
    low = _shifted(b[..., 32:96].unflatten(-1, (2, 1, 32)), [0, 2, 4, 6], 3).flatten(-3)  # [..., 256]
    high = _shifted(b[..., 0:32].unsqueeze(-2), list(range(8)), 1).flatten(-2)
    q = low.to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
    return (dl * q.unflatten(-1, (16, 16)).float()).flatten(-2)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's nibbles (at byte 48) with a 5th bit: sub-block s's from bit s of qh[32]."""
    scale, mins = _k_scales(b[..., 4:16])
    d = (_halves(b, 0) * scale.float()).unsqueeze(-1)
    m = (_halves(b, 2) * mins.float()).unsqueeze(-1)
    low = _shifted(b[..., 48:176].unflatten(-1, (4, 1, 32)), [0, 4], 15).flatten(-3, -2)  # [..., 8, 32]
    high = _shifted(b[..., 16:48].unsqueeze(-2), list(range(8)), 1)  # [..., 8, 32]
    return (d * (low | (high << 4)).float() - m).flatten(-2)


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _halves(b, 0) * torch.tensor(IQ4_VALUES, dtype=torch.float32)[_nibbles(b[..., 2:18]).long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """8 sub-blocks of 32 (16 bytes each, nibbles as IQ4_NL), 6-bit scales: 4 low bits from
    scales_l[4], 2 high from the uint16 scales_h; scale d (ls - 32)."""
    high = (b[..., 2:4].contiguous().view(torch.int16).int() & 0xFFFF) >> torch.arange(0, 16, 2, dtype=torch.int32)
    low = _shifted(b[..., 4:8].unsqueeze(-2), [0, 4], 15).transpose(-1, -2).flatten(-2).int()  # byte s // 2, nibble s % 2
    dl = (_halves(b, 0) * (low | ((high & 3) << 4)).sub(32).float()).unsqueeze(-1)
    q = _nibbles(b[..., 8:136].unflatten(-1, (8, 16))).long()  # [..., 8, 32]
    return (dl * torch.tensor(IQ4_VALUES, dtype=torch.float32)[q]).flatten(-2)


def _raw(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


_DECODERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    1: _raw(torch.float16), 2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0, 10: _q2_k, 11: _q3_k, 12: _q4_k,
    13: _q5_k, 14: _q6_k, 20: _iq4_nl, 23: _iq4_xs, 30: _raw(torch.bfloat16),
}


def dequantize_torch(qtype: int, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """blocks [rows, row_bytes] -> float32 [rows, in] by PyTorch bit operations (the fallback
    when the C kernels cannot be built; the same values)."""
    q = QTYPES[qtype]
    return _DECODERS[qtype](blocks.view(blocks.shape[0], in_features // q.block, q.bytes)).reshape(-1, in_features)


def q8_inputs_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] (in a multiple of 32) -> (q int8 [rows, in], d float32 [rows, in / 32]) exactly
    as quant_q8.h's ``q8_row`` quantises activations: per 32 inputs d = max|x| / 127, q =
    round(x (1 / d)) half away from zero, in float32 (a block with a NaN or infinity: d NaN, q 0)."""
    v = x.float().unflatten(-1, (-1, 32))
    a = v.abs()
    bad = ~(a <= torch.finfo(torch.float32).max).all(-1)
    d = torch.where(bad, 0.0, a.amax(-1)) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    t = torch.where(bad.unsqueeze(-1), 0.0, v * inv.unsqueeze(-1))
    whole = t.trunc()  # round half away from zero, exactly (t - whole is exact)
    q = (whole + torch.sign(t) * ((t - whole).abs() >= 0.5)).clamp(-127, 127)
    return q.to(torch.int8).flatten(-2), torch.where(bad, torch.nan, d)
