"""Counter-based random draws: one categorical draw per row for the whole batch, with no
per-row Python and no device synchronisation.

Why. Drawing each sampled row from its own `torch.Generator` costs a `torch.multinomial` and a
`.item()` per row per step: on a GPU that is a host-device round trip per row (64 rows, 64
synchronisations a step), and on any device the draw of a row depends on which rows shared its
generator and in what order. Here a row's randomness is a pure function of a 62-bit **key**
(its request's seed and its sample index, `row_key`) and a **counter** (how many tokens the
row has drawn): u = hash(key, counter), a float64 in [0, 1). The same row draws the same token
at the same position whatever batch it runs in, on any device, and the draws of a step are
one batched kernel sequence (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3",
for the counter-based idea; the mixing function here is a 32-bit integer hash, below).

The draw is inverse-transform sampling: with p the row's probabilities (exp of the pipeline's
float32 log-probabilities) and C their running sum, accumulated in float64, the token is the first index i with
C[i] > u * C[V-1]. It is an exact draw from that distribution (up to float64 rounding), never picks a
token of probability 0 (C[i] > C[i-1] there), and needs one uniform per row.

The hash works on int64 tensors holding 32-bit values, so it runs wherever PyTorch does (CPU,
CUDA) with no overflow: products are formed from 16-bit halves of the constants
(`_mul32`). The mixer is "lowbias32" (Chris Wellons' hash-prospector, 2020), a bijection on
32-bit words with near-ideal avalanche; four chained rounds mix the key's and the counter's
two 32-bit halves, two such chains with different salts give 53 bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

Words = TypeVar("Words", np.ndarray, torch.Tensor)
MASK32 = 0xFFFFFFFF
KEY_BITS = 62
_SALTS = (0x9E3779B9, 0x7F4A7C15)


def row_key(seed: int, sample: int) -> int:
    """The key of sample ``sample`` of a request seeded with ``seed``: splitmix64 of both
    (Steele et al. 2014), folded to 62 bits so it fits a signed int64 tensor."""
    z = (seed * 0x9E3779B97F4A7C15 + sample * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) >> (64 - KEY_BITS)


def _mul32(x: Words, c: int) -> Words:
    """(x * c) mod 2^32 for int64 ``x`` in [0, 2^32): by 16-bit halves of ``c``, no product
    passes 2^48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: Words) -> Words:
    """lowbias32: a bijective 32-bit mixer, elementwise on int64 arrays or tensors holding
    [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _word(keys: Words, counters: Words, salt: int) -> Words:
    x = mix32(((counters >> 32) & MASK32) ^ salt)
    x = mix32((counters & MASK32) ^ x)
    x = mix32(((keys >> 32) & MASK32) ^ x)
    return mix32((keys & MASK32) ^ x)


def uniforms(keys: Words, counters: Words) -> Words:
    """One uniform float64 in [0, 1) per row, a pure function of (key, counter): keys, counters
    [B] non-negative int64, numpy arrays (the decode loop's: a few microseconds for a batch on
    the host, against dozens of tiny kernel launches on a GPU) or tensors -> [B] float64 of the
    same kind, 53 random bits each."""
    hi = _word(keys, counters, _SALTS[0]) >> 6  # 26 bits
    lo = _word(keys, counters, _SALTS[1]) >> 5  # 27 bits
    bits = (hi << 27) | lo
    scale = 1.0 / (1 << 53)
    if isinstance(bits, torch.Tensor):
        return bits.to(torch.float64) * scale
    return bits.astype(np.float64) * scale


# probabilities [B, V] (float32), u [B] -> the tokens `cdf_search` gives, or None to leave it to it
Search = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def inverse_cdf(logprobs: torch.Tensor, u: torch.Tensor, search: Search | None = None) -> torch.Tensor:
    """The first index i of each row with C[i] > u * C[-1], C the running sum of exp(logprobs)
    accumulated in float64 in index order: logprobs [..., V], u [...] in [0, 1) -> tokens [...]
    long (the last index when no entry passes). A row with no finite entry gets a meaningless
    index (the caller reports such rows, `metaloom.decode.select.Drawn.failures`).

    ``search``: another way to the same tokens, tried first. The decode loop passes the C draw
    (`metaloom.models.kernels.draw.search`): it forms the running sums addition for addition as
    PyTorch's cumsum does, without cumsum's two float64 [B, V] tensors (16 rows of a 262k
    vocabulary: 20-25 ms a step). It returns None where it does not run (another device, no
    compiler); then PyTorch's cumsum and searchsorted (`cdf_search`)."""
    probs = logprobs.float().exp().reshape(-1, logprobs.shape[-1])  # float32 exp: 10x faster on CPUs
    u = u.reshape(-1)
    tokens = search(probs, u) if search is not None else None
    return (cdf_search(probs, u) if tokens is None else tokens).reshape(logprobs.shape[:-1])


def cdf_search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` of probabilities [B, V] (float32) by PyTorch's cumsum and searchsorted: the
    reference the C draw is held to, and the way on other devices."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    target = (u.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def row_uniforms(keys: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """[B] float64 uniforms on ``device`` for rows given as [B, 2] int64 (key, counter) on the host."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1, 2)
    return torch.from_numpy(uniforms(keys[:, 0], keys[:, 1])).to(device)
