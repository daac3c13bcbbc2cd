"""Triton kernels for the GPU's static decode step (`metaloom.models.engine.static_step`): fewer,
fused kernels a layer, and attention that reads the KV pool through the slot table.

Why. A batch-1 step of a 1B model reads 2 GB of weights in four matrix-vector products a
layer; everything else (norms, RoPE, KV writes, the key gathers, attention, the activation) was
about twenty small PyTorch kernels a layer, each a few microseconds of launch latency even
inside a CUDA graph, and each a node the graph launch pays for on the host (issue 35 measured
the captured step at 35% of copy bandwidth). Here a layer is four products and four kernels:

- `add_rms_norm`: the residual add and the next RMSNorm in one pass (the residual stream is
  rounded to the model dtype, as PyTorch's add does, before it is normed);
- `rope_write`: RoPE ("rotate half" layout, Su et al. 2021) on the queries and keys straight
  from the fused q|k|v projection, the rotated key and the value written to their pool slot,
  the rotated queries returned;
- `paged_attend`: one-token decode attention over the pool's slots through the row's table
  (one-token pages), grouped-query heads of a key-value head together, online softmax
  (Milakov & Gimelshein 2018), so forked rows read their shared prefix in place, with no
  gathered copy of the keys (at 64 rows x 512 keys the gather moved about 3 GB a step on the
  1B shape);
- `silu_mul`: SwiGLU's silu(gate) * up (Shazeer 2020).

Every kernel computes in float32 and rounds once on store. The same code runs on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, float32), where the tests check it against PyTorch
references; `available` says whether it can run here at all. Import is lazy: Triton is not a
dependency of metaloom (it comes with PyTorch's CUDA wheels).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import SimpleNamespace
from typing import Any

import torch

from metaloom.errors import InvalidParameter

MODES = ("auto", "on", "off")


def mode() -> str:
    """METALOOM_TRITON: auto (default: on CUDA when Triton imports), on (also the interpreter on
    the CPU, for tests), off."""
    value = os.environ.get("METALOOM_TRITON", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise InvalidParameter("METALOOM_TRITON", value, "auto, on or off")
    return value


def why_not(device: torch.device, head_dim: int) -> str | None:
    """Why the static step on ``device`` cannot use these kernels (None: it can)."""
    chosen = mode()
    if chosen == "off":
        return "METALOOM_TRITON=off"
    if not _installed():
        return "Triton is not installed"
    if device.type == "cpu" and (chosen != "on" or os.environ.get("TRITON_INTERPRET") != "1"):
        return "on the CPU only under the interpreter (METALOOM_TRITON=on TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton path on {device.type}"
    if head_dim & (head_dim - 1) or not 2 <= head_dim <= 256:
        return f"head_dim {head_dim} (a power of two from 2 to 256 here)"
    return None


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels(interpret: bool) -> Any:
    """The jitted kernels (built on first use: Triton reads TRITON_INTERPRET when a kernel is
    defined, so the interpreter's and the device's are built apart; each `_..._kernel` below
    defines its kernel afresh when called)."""
    del interpret  # part of the cache key only
    return SimpleNamespace(add_rms_norm=_add_rms_norm_kernel(), rope_write=_rope_write_kernel(),
                           paged_attend=_paged_attend_kernel(), combine=_combine_kernel(),
                           silu_mul=_silu_mul_kernel())


def _add_rms_norm_kernel() -> Any:
    """The residual add and the next RMSNorm in one pass, a program a row (`add_rms_norm`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, res_ptr, out_ptr, d, eps,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < d
        x = tl.load(x_ptr + row * d + cols, mask=keep, other=0.0)
        if HAS_DELTA:
            x = x + tl.load(delta_ptr + row * d + cols, mask=keep, other=0.0)
            x = x.to(res_ptr.dtype.element_ty)  # the residual stream, rounded as PyTorch's add rounds it
            tl.store(res_ptr + row * d + cols, x, mask=keep)
        x = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * d + cols, x * inv * w, mask=keep)

    return add_rms_norm_kernel


def _rope_write_kernel() -> Any:
    """RoPE on the queries and keys of the fused q|k|v product, the rotated key and the value
    written to their pool slot, a program a (token, head) (`rope_write`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_pool, v_pool,
                          h, hk, D: tl.constexpr, HALF: tl.constexpr):
        n = tl.program_id(0)
        head = tl.program_id(1)  # h query heads, then hk key heads (whose values ride along)
        i = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + n)
        width = (h + 2 * hk) * D
        src = qkv_ptr + n * width + head * D
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
        c = tl.load(cos_ptr + pos * D + i).to(tl.float32)  # rotate-half tables repeat their first half
        s = tl.load(sin_ptr + pos * D + i).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        if head < h:
            dst = q_ptr + (n * h + head) * D
            tl.store(dst + i, y1)
            tl.store(dst + HALF + i, y2)
        else:
            kh = head - h
            slot = tl.load(slot_ptr + n)
            dst = k_pool + (slot * hk + kh) * D
            tl.store(dst + i, y1)
            tl.store(dst + HALF + i, y2)
            vsrc = qkv_ptr + n * width + (h + hk + kh) * D
            vdst = v_pool + (slot * hk + kh) * D
            tl.store(vdst + i, tl.load(vsrc + i))
            tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i))

    return rope_write_kernel


def _paged_attend_kernel() -> Any:
    """One-token attention through the slot table, a program a (row, key-value head, chunk of
    keys) (`paged_attend`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attend_kernel(q_ptr, k_pool, v_pool, table_ptr, table_stride, len_ptr, out_ptr, m_ptr, l_ptr,
                            hk, scale, window,
                            G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr):
        # program (row, key-value head, chunk of keys); with one chunk it writes the output,
        # else the chunk's unnormalised partial softmax (max, sum, weighted values) for
        # `combine_kernel` (split keys: flash-decoding, Dao et al. 2023)
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        g = tl.arange(0, GP)
        dd = tl.arange(0, BLOCK_D)
        gk = g < G
        dk = dd < D
        h = hk * G
        q = tl.load(q_ptr + (r * h + kvh * G + g[:, None]) * D + dd[None, :], mask=gk[:, None] & dk[None, :],
                    other=0.0).to(tl.float32) * scale
        length = tl.load(len_ptr + r)
        start = tl.maximum(length - window, 0)
        m_i = tl.full((GP,), -1.0e30, tl.float32)  # finite: a block with no attended key changes nothing
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, BLOCK_D), tl.float32)
        # compile-time bounds (one kernel a key bucket; Triton's interpreter cannot loop to a
        # run-time value); blocks past a row's length load nothing and change nothing
        for i in range(0, CHUNK, BLOCK_N):
            offs = part * CHUNK + i + tl.arange(0, BLOCK_N)
            live = (offs < length) & (offs >= start)
            slots = tl.load(table_ptr + r * table_stride + offs, mask=live, other=0)
            at = (slots[:, None] * hk + kvh) * D + dd[None, :]
            k = tl.load(k_pool + at, mask=live[:, None] & dk[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_pool + at, mask=live[:, None] & dk[None, :], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        if SPLITS == 1:
            acc = acc / l_i[:, None]
            tl.store(out_ptr + (r * h + kvh * G + g[:, None]) * D + dd[None, :], acc,
                     mask=gk[:, None] & dk[None, :])
        else:
            at = ((r * hk + kvh) * SPLITS + part) * GP + g
            tl.store(m_ptr + at, m_i)
            tl.store(l_ptr + at, l_i)
            tl.store(out_ptr + at[:, None] * BLOCK_D + dd[None, :], acc)

    return paged_attend_kernel


def _combine_kernel() -> Any:
    """The chunks' partial softmaxes merged by log-sum-exp (`paged_attend` with split keys)."""
    import triton
    import triton.language as tl

    @triton.jit
    def combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, hk, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
        # the chunks' partial softmaxes of one (row, key-value head), merged by log-sum-exp
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        g = tl.arange(0, GP)
        dd = tl.arange(0, BLOCK_D)
        m_i = tl.full((GP,), -1.0e30, tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, BLOCK_D), tl.float32)
        for part in range(0, SPLITS):
            at = ((r * hk + kvh) * SPLITS + part) * GP + g
            m_p = tl.load(m_ptr + at)
            m_new = tl.maximum(m_i, m_p)
            alpha = tl.exp(m_i - m_new)
            beta = tl.exp(m_p - m_new)
            l_i = l_i * alpha + tl.load(l_ptr + at) * beta
            acc = acc * alpha[:, None] + tl.load(acc_ptr + at[:, None] * BLOCK_D + dd[None, :]) * beta[:, None]
            m_i = m_new
        acc = acc / l_i[:, None]
        h = hk * G
        tl.store(out_ptr + (r * h + kvh * G + g[:, None]) * D + dd[None, :], acc, mask=(g < G)[:, None] & (dd < D)[None, :])

    return combine_kernel


def _silu_mul_kernel() -> Any:
    """SwiGLU's silu(gate) * up, a program a (token, block of columns) (`silu_mul`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < inter
        gate = tl.load(x_ptr + n * 2 * inter + cols, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + n * 2 * inter + inter + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * inter + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=keep)

    return silu_mul_kernel


def _k() -> Any:
    return _kernels(os.environ.get("TRITON_INTERPRET") == "1")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual, normed): residual = x + delta (x itself without delta), normed =
    RMSNorm(residual) * weight; x, delta [..., d] contiguous, same dtype."""
    d = x.shape[-1]
    rows = x.numel() // d
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    _k().add_rms_norm[(rows,)](x, delta if delta is not None else x, weight, res, out, d, eps,
                               HAS_DELTA=delta is not None, BLOCK=_pow2(d))
    return res, out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, h: int, hk: int) -> torch.Tensor:
    """qkv [N, (h + 2 hk) D] (N tokens, contiguous); cos, sin [P, D] rotate-half tables;
    positions, slots [N] long. Writes each token's rotated key and its value at its slot of
    ``keys``/``values`` [S, hk, D] and returns the rotated queries [N, h, D]."""
    d = keys.shape[-1]
    n = qkv.shape[0]
    positions, slots = positions.contiguous(), slots.contiguous()  # the kernel steps through them one by one
    q = torch.empty((n, h, d), dtype=qkv.dtype, device=qkv.device)
    _k().rope_write[(n, h + hk)](qkv, cos, sin, positions, slots, q, keys, values, h, hk, D=d, HALF=d // 2)
    return q


RESIDENT_PROGRAMS = 2048  # about what an H100's 132 SMs keep in flight of 4-warp programs


def splits(programs: int, max_len: int, block_n: int, chunks: int | None = None) -> tuple[int, int]:
    """(keys a chunk, chunks) for ``programs`` (rows x key-value heads) over ``max_len`` keys:
    enough chunks that the device has about `RESIDENT_PROGRAMS` programs to hide the latency of
    reading keys through the table (at 64 rows, one program a row and head walking 512 keys
    was slower than PyTorch's gather and attention), each chunk a whole number of blocks.
    ``chunks``: ask for that many (tests)."""
    blocks = -(-max_len // block_n)
    want = chunks if chunks is not None else -(-RESIDENT_PROGRAMS // max(programs, 1))
    per = -(-blocks // max(1, min(want, blocks)))  # blocks a chunk
    return per * block_n, -(-blocks // per)


def paged_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, max_len: int, scale: float, window: int | None,
                 chunks: int | None = None) -> torch.Tensor:
    """One query token a row: q [R, h, D]; keys, values [S, hk, D]; table [R, >= max_len] long
    (a row's slot at each position, row stride free); lengths [R] (keys a row attends, its new
    one included, at most ``max_len``) -> [R, h * D] in q's dtype. ``window``: attend only the
    last ``window`` keys (sliding-window models). ``chunks``: split each row's keys into that
    many (default: `splits`)."""
    r, h, d = q.shape
    hk = keys.shape[1]
    lengths = lengths.contiguous()
    if table.stride(1) != 1:
        raise ValueError("the slot table's rows must be contiguous")
    g = h // hk
    gp = max(_pow2(g), 2)
    out = torch.empty((r, h * d), dtype=q.dtype, device=q.device)
    block_d = _pow2(d)
    block_n = 32 if block_d * gp <= 256 else 16  # the [g, n, d] products stay in registers
    chunk, parts = splits(r * hk, max_len, block_n, chunks)
    k = _k()
    common = dict(G=g, GP=gp, D=d, BLOCK_D=block_d)
    if parts == 1:
        k.paged_attend[(r, hk, 1)](q, keys, values, table, table.stride(0), lengths, out, out, out, hk, scale,
                                   window or 1 << 30, BLOCK_N=block_n, CHUNK=chunk, SPLITS=1, **common)
        return out
    m = torch.empty((r, hk, parts, gp), dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    acc = torch.empty((r, hk, parts, gp, block_d), dtype=torch.float32, device=q.device)
    k.paged_attend[(r, hk, parts)](q, keys, values, table, table.stride(0), lengths, acc, m, s, hk, scale,
                                   window or 1 << 30, BLOCK_N=block_n, CHUNK=chunk, SPLITS=parts, **common)
    k.combine[(r, hk)](acc, m, s, out, hk, SPLITS=parts, **common)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] (gate | up, contiguous) -> silu(gate) * up [..., I]."""
    inter = gate_up.shape[-1] // 2
    n = gate_up.numel() // (2 * inter)
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inter))
    _k().silu_mul[(n, -(-inter // block))](gate_up, out, inter, BLOCK=block)
    return out
