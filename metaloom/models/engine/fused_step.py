"""One-token steps and short speculative verifies of the native model through the fused CPU kernels
(`metaloom.models.kernels.fused`): everything between the matmuls in a few C calls per layer, or
every layer in one (`metaloom.models.engine.stack`). A prompt takes them too, each token a row
of its own, while its rows end within `FUSED_PREFILL_KEYS` keys: its hidden states are then
those of feeding it one token at a time, to the bit (its logits too where the head keeps rows
apart, as the quantised heads do). Longer prompts take the PyTorch ops
(`metaloom.models.engine.eager`).

Each family's differences (`metaloom.models.engine.config`) run here too: per-head q/k norms
before RoPE, norms of the attention's and MLP's outputs, GeGLU, the attention's own scale and
soft-capping, and each layer's window and RoPE tables. Shared-prefix attention reads the shared
keys once only in layers without a window, and never under soft-capped scores.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from metaloom.errors import UnsupportedModel
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.pool import KVPool
from metaloom.models.engine.sharing import Sharing, find_sharing
from metaloom.models.engine.stack import Plan, pointers
from metaloom.models.engine.weights import linear
from metaloom.models.kernels.fused import ACTIVATIONS, PARALLEL_MIN_KEYS, Drops, FusedKernels

if TYPE_CHECKING:
    from metaloom.models.engine.llama import LlamaModel

# shared-prefix attention's ``auto``: on when a step's rows share at least this many key reads
# per layer and kv head (the sum over shared spans of (rows - 1) x span length); below it the
# per-row kernel is as fast (measured: `metaloom bench fork --case shared`)
AUTO_SHARED_READS = 4096
# the widest block a row may take through the fused kernels as a verify (`verify_fused`): a
# pending token and up to 64 drafted ones (metaloom.speculative.drafter.MAX_DRAFT), whatever
# the keys before it
FUSED_VERIFY_WIDTH = 65
# a wider block (a prompt, or its continuation) takes them while no row ends past this many
# keys. Each token attends its keys alone there, so attention costs more than PyTorch's blocked
# SDPA over a long block, but the rest of a layer runs in a few C calls instead of ~20 PyTorch
# ops, and over the rows the block holds rather than its padding. SmolLM2 q8 prefills, fused
# against PyTorch's ops (AMD EPYC Zen 5, `python scripts/prefill_paths.py`): avx512 1.40x at 50
# tokens, 1.20x at 200, 1.12x at 1024, 0.99x at 1600; avx2 1.33x at 50, 1.17x at 200, 1.15x at
# 512, 1.02x at 800 (0.80x in an earlier run). Qwen2.5-Coder-0.5B 1.11-1.23x and Gemma 3 270M
# 1.33-1.81x at 100 to 1024 tokens (avx512).
FUSED_PREFILL_KEYS = {"avx512": 1024}
FUSED_PREFILL_KEYS_ELSEWHERE = 512


def fused_reads(m: LlamaModel, pool: KVPool) -> bool:
    """Whether the fused kernels read ``pool`` as it stores keys: a pool of the model's dtype,
    or an int8 one (codes and scales, read and written in C). A float pool of another type
    (``--kv-dtype bfloat16`` under a float32 model) takes the PyTorch ops' one-token step,
    which converts on write and read."""
    return pool.compute_dtype == m.dtype and pool.dtype in (m.dtype, torch.int8)


def step_fused(m: LlamaModel, tokens: torch.Tensor, cache: PagedKVCache, lengths: torch.Tensor,
               valid: torch.Tensor, k: FusedKernels) -> torch.Tensor:
    """`LlamaModel._hidden` for one new token per row: the same arithmetic, a few kernel calls and
    four matmuls per layer. The new position's slot is already in the cache's table
    (`PagedKVCache.prepare`). -> [B, 1, d]"""
    table = cache.table()
    drops = _drops(m, cache, table.shape[1])
    sharing = None if drops.sinks is not None or drops.probs is not None else sharing_of(m, cache.slots,
                                                                                       cache.host_lengths())
    y = fused_rows(m, tokens[:, 0], lengths.contiguous(), table, cache.pool, sharing, drops, k)
    if drops.probs is not None:  # H2O: each entry's attention this step, summed over heads and layers
        cache.attention_mass()[:, :table.shape[1]] += drops.probs.sum(1).double().numpy()
    cache.advance(valid)
    return y[:, None]


def attention_threads(rows: int, longest: int, available: int) -> int:
    """The threads a fused step's attention splits over: all ``available`` once ``rows`` rows
    read enough cached keys (the longest row's ``longest`` plus its new one) to pay for a parallel
    region in each layer (`PARALLEL_MIN_KEYS`), else one. The tasks (row, kv head, and a long
    row's half) follow from the rows' positions alone, so the split does not change a row's
    arithmetic."""
    return available if rows * (longest + 1) >= PARALLEL_MIN_KEYS else 1


def fused_rows(m: LlamaModel, tokens: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, pool: KVPool,
               sharing: Sharing | None, drops: Drops, k: FusedKernels) -> torch.Tensor:
    """One new token per row through the fused kernels: tokens [R] at positions lengths [R],
    each row's slots table [R, width] (its new slot at its length). -> [R, d] after the final
    norm. A row's arithmetic does not depend on the other rows (the quantised matmuls keep
    rows apart, attention is per row) unless ``sharing`` merges their shared keys' parts."""
    c = m.config
    b, h, hk = tokens.shape[0], c.num_attention_heads, c.num_key_value_heads
    x = m.embed_rows(tokens)  # [R, d], a fresh tensor: the residual stream
    y = torch.empty_like(x)
    attn = x.new_empty(b, h * c.head_dim)
    act = x.new_empty(b, c.intermediate_size)
    if not fused_reads(m, pool) or not pool.keys[0].is_contiguous() or not table.is_contiguous():
        raise UnsupportedModel("the fused step needs the contiguous KV pool of new_cache()")
    threads = attention_threads(b, int(lengths.max()), torch.get_num_threads())
    plan = m._plan(b)
    eps, scale, cap = c.rms_norm_eps, c.attention_scale, c.attn_softcap
    if plan is not None:  # every layer in one call: the same kernels, in the same order (metaloom.models.engine.stack)
        delta = _step_stack(m, plan, k, x, y, attn, act, lengths, table, pool, threads, sharing, drops)
    else:
        delta = None  # the last sublayer's output, added to x by the next norm
        for i, w in enumerate(m.layers):
            k.residual_rms_norm(x, delta, w.attn_norm, y, eps)
            qkv = linear(y, w.qkv, w.qkv_bias).contiguous()
            if w.q_norm is not None and w.k_norm is not None:
                k.head_rms_norm(qkv, w.q_norm, w.k_norm, h, hk, eps)
            scales = (pool.key_scales[i], pool.value_scales[i]) if pool.quantized else None
            cos, sin = m.ropes[i]
            window = m.windows[i]
            k.rope_attend(qkv, cos, sin, lengths, table, pool.keys[i], pool.values[i], attn, h, window, threads,
                          None if window is not None else sharing, scales, drops, scale, cap)
            out = linear(attn, w.o).contiguous()
            if w.post_attn_norm is not None:
                k.residual_rms_norm(out, None, w.post_attn_norm, out, eps)
            k.residual_rms_norm(x, out, w.mlp_norm, y, eps)
            k.glu_mul(linear(y, w.gate_up).contiguous(), act, c.activation)
            delta = linear(act, w.down).contiguous()
            if w.post_mlp_norm is not None:
                k.residual_rms_norm(delta, None, w.post_mlp_norm, delta, eps)
    k.residual_rms_norm(x, delta, m.norm, y, eps)
    return y


def verify_applies(m: LlamaModel, cache: PagedKVCache, t: int, tree: torch.Tensor | None) -> bool:
    """Whether a block of ``t`` > 1 tokens per row takes `verify_fused`: the fused kernels read
    this pool, no row drops positions (``--kv-policy``), a sliding window only for a chain (its
    window is per position, which a tree's depths are not), and either the block is a verify
    (every row holds keys, at most `FUSED_VERIFY_WIDTH` tokens) or, in a float pool, no row ends
    past `prefill_keys` keys (a prompt)."""
    if not (t > 1 and m.fused is not None and cache.batch > 0 and fused_reads(m, cache.pool)
            and not m.options.drops and (tree is None or m.config.sliding_window is None)):
        return False
    held = cache.host_lengths()
    if t <= FUSED_VERIFY_WIDTH and bool(held.all()):
        return True
    # an int8 pool stays on the PyTorch ops, which attend a prompt's own keys before they are
    # quantised (the fused kernels read them back from the pool)
    return not cache.pool.quantized and int(held.max()) + t <= prefill_keys(m.fused.isa)


def prefill_keys(isa: str) -> int:
    """The most keys a row may end with for a wide block to take the fused kernels on ``isa``."""
    return FUSED_PREFILL_KEYS.get(isa, FUSED_PREFILL_KEYS_ELSEWHERE)


def verify_fused(m: LlamaModel, tokens: torch.Tensor, cache: PagedKVCache, valid: torch.Tensor,
                 tree: torch.Tensor | None, last_only: bool, k: FusedKernels) -> torch.Tensor:
    """`LlamaModel._hidden` for a block of tokens per row (a speculative verify: the pending
    token and the drafts, as a chain or a token tree; or a prompt) through the one-token fused
    kernels. Each kept token is a row of its own, at its position (length +
    depth), whose slot table is its row's cached slots followed by the new slots of its
    ancestors and its own; fused.c writes every row's new key before any row attends, so a
    token attends the ancestors written in the same call.

    Why: on the PyTorch ops a 2-token verify of SmolLM2 (native float32, after 400 tokens)
    cost 15.6 ms against a one-token step's 7.0, most of the difference dispatch and SDPA
    with a mask rather than arithmetic; here it costs 10.3 (scripts/verify_cost.py). A
    token's arithmetic is exactly a one-token step's (the quantised matmuls keep rows apart,
    and attention is per row), so a greedy verify's argmaxes are plain greedy's bits, not
    only to rounding. Shared-prefix attention, which merges the tokens' reads of the prompt in
    another order, takes a verify only when turned ``on``: under ``auto`` it did not pay for
    its rounding (`sharing_of`). -> [B, T, d] ([B, 1, d] with ``last_only``), zeros at padding."""
    b, t = tokens.shape
    n = cache.host_lengths()  # before this forward: row b's block has slots at n[b] .. n[b] + valid[b] - 1
    keep = valid.tolist()
    rows_b = np.repeat(np.arange(b), keep)
    rows_i = np.concatenate([np.arange(v) for v in keep]) if b else np.zeros(0, dtype=np.int64)
    out = torch.zeros(b, t, m.config.hidden_size, dtype=m.dtype, device=tokens.device)
    if rows_b.size:
        mask = None if tree is None else tree.cpu().numpy()
        depth = rows_i if mask is None else mask[rows_b, rows_i].sum(-1) - 1
        lengths = n[rows_b] + depth
        # a chain's tokens read their row's own table, which lists the block in order; a tree
        # node's lists its ancestors (and itself) in depth order there instead: in a topological
        # order every ancestor comes before its descendants
        table = np.ascontiguousarray(cache.slots[rows_b, :int(lengths.max()) + 1])
        if mask is not None:
            for r, (row, i) in enumerate(zip(rows_b.tolist(), rows_i.tolist(), strict=True)):
                path = np.flatnonzero(mask[row, i, :i + 1])
                table[r, n[row]:n[row] + path.size] = cache.slots[row, n[row] + path]
        sharing = sharing_of(m, table, lengths, verify=True)
        y = fused_rows(m, tokens[torch.from_numpy(rows_b), torch.from_numpy(rows_i)], torch.from_numpy(lengths),
                       torch.from_numpy(table), cache.pool, sharing, Drops(), k)
        out[torch.from_numpy(rows_b), torch.from_numpy(rows_i)] = y
    cache.advance(valid)
    if last_only:
        out = out[torch.arange(b), valid - 1][:, None]
    return out


def _drops(m: LlamaModel, cache: PagedKVCache, width: int) -> Drops:
    """What the fused kernels need of rows that dropped positions (``--kv-policy``): each
    row's shift, its sinks (StreamingLLM), a buffer for H2O's attention probabilities."""
    shift = torch.from_numpy(cache.shift) if cache.drops else None
    sinks = torch.from_numpy(cache.sinks) if shift is not None and cache.sinks.any() else None
    probs = None
    if m.options.kv_policy == "h2o":
        probs = torch.zeros(cache.batch, m.config.num_key_value_heads, width, dtype=torch.float32)
    return Drops(shift, sinks, probs)


def _step_stack(m: LlamaModel, plan: Plan, k: FusedKernels, x: torch.Tensor, y: torch.Tensor, attn: torch.Tensor,
                act: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, pool: KVPool,
                threads: int, sharing: Sharing | None = None, drops: Drops | None = None) -> torch.Tensor:
    """`fused_rows`' layers in one C call (fused.c's ``decode_layers``), on the same buffers;
    -> the last sublayer's output (x is the residual stream before it, as the loop leaves it)."""
    c = m.config
    b, h, hk = x.shape[0], c.num_attention_heads, c.num_key_value_heads
    delta = torch.empty_like(x)
    qkv = x.new_empty(b, (h + 2 * hk) * c.head_dim)
    gu = x.new_empty(b, 2 * c.intermediate_size)
    rc = k.lib.decode_layers(plan.layers, plan.count, x.data_ptr(), delta.data_ptr(), y.data_ptr(), qkv.data_ptr(),
                             attn.data_ptr(), gu.data_ptr(), act.data_ptr(), lengths.data_ptr(), table.data_ptr(),
                             table.shape[1], pointers(pool.keys), pointers(pool.values), b, c.hidden_size, h, hk,
                             c.head_dim, c.intermediate_size, threads, torch.get_num_threads(), c.rms_norm_eps,
                             m.dtype == torch.bfloat16, None if sharing is None else ctypes.byref(sharing.desc),
                             pointers(pool.key_scales) if pool.quantized else None,
                             pointers(pool.value_scales) if pool.quantized else None,
                             *(drops or Drops()).pointers(), ACTIVATIONS[c.activation], c.attention_scale,
                             c.attn_softcap or 0.0)
    if rc:
        raise RuntimeError(f"decode_layers failed with code {rc}")  # the plan's shapes were checked: a bug
    return delta


def sharing_of(m: LlamaModel, slots: np.ndarray, lengths: np.ndarray, verify: bool = False) -> Sharing | None:
    """The positions rows with slot table ``slots`` [R, width] and ``lengths`` [R] (each row's
    new position) share in the pool, for shared-prefix attention
    (`metaloom.models.engine.sharing`), or None: turned off, a sliding window in some layer (its
    rows attend different spans), soft-capped scores, nothing shared, or (``auto``) too little
    shared to gain, or the rows are a speculative verify's tokens (``verify``).

    Why a verify shares only when turned ``on``: merged, a drafted token's logits are not a
    one-token step's bits, so speculative greedy can leave plain greedy's tokens at a near tie
    (seen under q8 with Token Recycling at K = 16). And since the per-row kernel reads each key
    once per group, merging no longer pays there: SmolLM2, a 21-token tree, AMD EPYC Zen 3, 2
    threads, `scripts/verify_cost.py`: 91 / 107 ms without / with at 400 positions, 137 / 156 at
    1,000, 173 / 183 at 2,000, 229 / 210 at 4,000."""
    mode = m.options.shared_prefix_attention
    c = m.config
    if mode == "off" or (verify and mode != "on") or len(lengths) < 2 or c.sliding_window is not None \
            or c.attn_softcap is not None:
        return None
    found = find_sharing(slots, lengths)
    if found is None or (mode == "auto" and found.saved_reads() < AUTO_SHARED_READS):
        return None
    return found
