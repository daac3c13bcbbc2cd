"""quant.c's panel layout written out a second time, bit by bit, in Python: which bit of the 16
GGUF blocks each bit of a panel block holds. `unpanel_numpy` turns panels back into GGUF's
layout with it where the C kernels are gone, and the tests hold the C regrouping to it.

A panel block is the same 16 outputs' block b regrouped so that the 16 outputs sit in the 16
lanes of a vector (quant.c says why and documents each type's layout); nothing is requantised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

PANEL = 16  # outputs per panel
# ggml type id -> block bytes, for the types with a panel layout
BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 10: 84, 11: 110, 12: 144, 13: 176, 14: 210, 20: 18, 23: 136}
PANEL_TYPES = frozenset(BYTES)

Move = Callable[[int, int, int, int, int, int], None]  # (j, gguf byte, bit, panel byte, bit, width)


def q5_hi_bit(i: int) -> int:
    """Q5_0 / Q5_1 / Q5_K: the bit of a panel hi word holding element i's 5th bit (8v+k: v + 4k + 4,
    or v for k = 7)."""
    return i // 8 + (4 * (i % 8) + 4 if i % 8 < 7 else 0)


def _small(move: Move, qtype: int, j: int, odd: bool) -> None:
    """Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: head (d, m, hi) and nib; odd blocks of the types whose 16
    blocks are not whole cache lines put the head first."""
    head_size = {2: 32, 20: 32, 3: 64, 6: 96, 7: 128}[qtype]
    nib, head = (head_size, 0) if odd and qtype in (2, 6, 20) else (0, 256)
    move(j, 0, 0, head + 2 * j, 0, 16)  # d
    if qtype in (3, 7):
        move(j, 2, 0, head + 32 + 2 * j, 0, 16)  # m
    qs = {2: 2, 20: 2, 3: 4, 6: 6, 7: 8}[qtype]
    for e in range(32):
        move(j, qs + e % 16, 4 * (e // 16), nib + 64 * (e // 8) + 4 * j + (e % 8) // 2, 4 * (e % 2), 4)
    if qtype in (6, 7):
        qh, hi = (2, head + 32) if qtype == 6 else (4, head + 64)
        for i in range(32):
            bit = q5_hi_bit(i)
            move(j, qh + i // 8, i % 8, hi + 4 * j + bit // 8, bit % 8, 1)


def _k32(move: Move, qtype: int, j: int) -> None:
    """Q4_K, Q5_K, IQ4_XS (sub-blocks of 32): nib [8][4][16] u32, then (Q5_K) hi [8][16] u32, d,
    dmin (IQ4_XS: scales_h) and the scale bytes (IQ4_XS: scales_l)."""
    hi, d, dmin, sc = {12: (0, 2048, 2080, 2112), 13: (2048, 2560, 2592, 2624), 23: (0, 2048, 2080, 2112)}[qtype]
    move(j, 0, 0, d + 2 * j, 0, 16)
    move(j, 2, 0, dmin + 2 * j, 0, 16)
    if qtype == 23:
        move(j, 4, 0, sc + 4 * j, 0, 32)
    else:
        for w in range(3):
            move(j, 4 + 4 * w, 0, sc + 64 * w + 4 * j, 0, 32)
    for e in range(256):
        sb, lane, k = e // 32, e % 32, e % 8
        to = 256 * sb + 64 * (lane // 8) + 4 * j + k // 2
        if qtype == 23:  # sub-block sb: 16 bytes at 8 + 16 sb, elements lane and lane + 16 in one
            move(j, 8 + 16 * sb + lane % 16, 4 * (lane // 16), to, 4 * (k % 2), 4)
        else:  # sub-blocks 2i, 2i + 1: the low and high nibbles of 32 bytes
            move(j, (16 if qtype == 12 else 48) + 32 * (sb // 2) + lane, 4 * (sb % 2), to, 4 * (k % 2), 4)
        if qtype == 13:  # the 5th bit: bit sb of qh[lane]
            bit = q5_hi_bit(lane)
            move(j, 16 + lane, sb, hi + 64 * sb + 4 * j + bit // 8, bit % 8, 1)


def _k16(move: Move, qtype: int, j: int, odd: bool) -> None:
    """Q2_K, Q3_K (sub-blocks of 16): element 128n + 32jj + 16h + l is element l of sub-block
    i = 8n + 2jj + h, its 2 low bits at 4 (l % 8) + 2 (l // 8) of word i; Q3_K's third bit at
    4 (l % 8) + l // 8 + 2 (i % 2) of hi word i // 2."""
    if qtype == 10:
        q, hi, sc, d = 0, 0, 1024, 1280
        for w in range(4):
            move(j, 4 * w, 0, sc + 64 * w + 4 * j, 0, 32)
        move(j, 80, 0, d + 2 * j, 0, 16)
        move(j, 82, 0, 1312 + 2 * j, 0, 16)  # dmin
    else:
        d, q, hi, sc = (0, 32, 1056, 1568) if odd else (1728, 0, 1024, 1536)
        for w in range(3):
            move(j, 96 + 4 * w, 0, sc + 64 * w + 4 * j, 0, 32)
        move(j, 108, 0, d + 2 * j, 0, 16)
    qs = 16 if qtype == 10 else 32
    for e in range(256):
        n, jj, h, lo = e // 128, (e % 128) // 32, (e % 32) // 16, e % 16
        i = 8 * n + 2 * jj + h
        bit = 4 * (lo % 8) + 2 * (lo // 8)
        move(j, qs + 32 * n + 16 * h + lo, 2 * jj, q + 64 * i + 4 * j + bit // 8, bit % 8, 2)
        if qtype == 11:
            hb = 4 * (lo % 8) + lo // 8 + 2 * (i % 2)
            move(j, 16 * h + lo, 4 * n + jj, hi + 64 * (i // 2) + 4 * j + hb // 8, hb % 8, 1)


def _q6k(move: Move, j: int, odd: bool) -> None:
    """Q6_K: nib [32][16] u32, hi [16][16] u32, scales [4][16] u32, d[16]; odd blocks: d first."""
    d_at, nib, hi, sc = (0, 32, 2080, 3104) if odd else (3328, 0, 2048, 3072)
    move(j, 208, 0, d_at + 2 * j, 0, 16)
    for w in range(4):
        move(j, 192 + 4 * w, 0, sc + 64 * w + 4 * j, 0, 32)
    for e in range(256):
        n, c, lane, g, k = e // 128, (e % 128) // 32, e % 32, e // 8, e % 8
        move(j, 64 * n + lane + 32 * (c % 2), 4 * (c // 2), nib + 64 * g + 4 * j + k // 2, 4 * (k % 2), 4)
        hs = (4 * k + 4 if k < 7 else 0) + 2 * (g % 2)
        move(j, 128 + 32 * n + lane, 2 * c, hi + 64 * (g // 2) + 4 * j + hs // 8, hs % 8, 2)


@functools.cache
def panel_sources(qtype: int, odd: bool) -> np.ndarray:
    """For one panel block of ``qtype`` (16 outputs' blocks regrouped; ``odd``: its index from the
    weight's first block is odd): for each of its bits, the bit of the 16 GGUF blocks it holds
    (bits counted little-endian within bytes, output j's block at j * bytes * 8)."""
    bb = BYTES[qtype]
    src = np.full(16 * bb * 8, -1, dtype=np.int64)

    def move(j: int, gbyte: int, gbit: int, pbyte: int, pbit: int, width: int) -> None:
        src[pbyte * 8 + pbit:pbyte * 8 + pbit + width] = np.arange(width) + j * bb * 8 + gbyte * 8 + gbit

    for j in range(16):
        if qtype in (2, 3, 6, 7, 20):
            _small(move, qtype, j, odd)
        elif qtype in (12, 13, 23):
            _k32(move, qtype, j)
        elif qtype in (10, 11):
            _k16(move, qtype, j, odd)
        else:
            _q6k(move, j, odd)
    assert (src >= 0).all() and len(set(src.tolist())) == src.size  # a permutation of the bits
    return src


def unpanel_numpy(qtype: int, panels: torch.Tensor, in_features: int, block: int) -> torch.Tensor:
    """GGUF blocks [out, row_bytes] from quant.c's panel layout (``block``: elements a block), by
    numpy bit moves (`panel_sources`): what the C kernels' ``quant_panel(back=1)`` gives."""
    bb = BYTES[qtype]
    out, nb = panels.shape[0], in_features // block
    blocks = panels.numpy().reshape(out // PANEL * nb, PANEL * bb)  # [panel block, bytes]
    bits = np.unpackbits(blocks, axis=1, bitorder="little")
    gguf_bits = np.empty_like(bits)
    for odd in (False, True):
        rows = np.arange(odd, blocks.shape[0], 2)
        gguf_bits[np.ix_(rows, panel_sources(qtype, odd))] = bits[rows]
    g = np.packbits(gguf_bits, axis=1, bitorder="little").reshape(out // PANEL, nb, PANEL, bb)
    return torch.from_numpy(np.ascontiguousarray(g.transpose(0, 2, 1, 3).reshape(out, nb * bb)))
