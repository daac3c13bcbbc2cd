"""A preallocated KV cache with per-row lengths.

Layout per layer: keys and values [B, H_kv, capacity, D]. Row ``b`` holds its first
``lengths[b]`` positions; anything after is garbage and masked out. Rows of different lengths
live in one batch without left padding: each row writes at its own offset and the attention
mask hides keys past each query's position, so a row gives the same tokens alone or batched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from metaloom.errors import CacheFull, InvalidParameter


class StaticKVCache:
    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._lengths = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def batch(self) -> int:
        return self._lengths.shape[0]

    def reserve(self, new_tokens: int) -> None:
        """Raise `CacheFull` if appending ``new_tokens`` to the longest row would overflow."""
        need = int(self._lengths.max()) + new_tokens if self.batch else new_tokens
        if need > self.capacity:
            raise CacheFull(f"KV cache needs {need} positions but was allocated {self.capacity}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, uniform: bool) -> None:
        """Write k, v [B, H_kv, T, D] at each row's current length (lengths advance later,
        once for all layers, in `advance`)."""
        t = k.shape[2]
        if uniform:
            start = int(self._lengths[0])
            self.keys[layer][:, :, start:start + t] = k
            self.values[layer][:, :, start:start + t] = v
            return
        pos = self._lengths[:, None] + torch.arange(t, device=k.device)  # [B, T]
        rows = torch.arange(self.batch, device=k.device)[:, None]
        # advanced indices (rows, pos) around a slice put [B, T] first: target [B, T, H, D]
        self.keys[layer][rows, :, pos] = k.transpose(1, 2)
        self.values[layer][rows, :, pos] = v.transpose(1, 2)

    def advance(self, valid: torch.Tensor) -> None:
        self._lengths = self._lengths + valid

    def fork(self, rows: Sequence[int]) -> StaticKVCache:
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self._lengths.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.batch):
            raise InvalidParameter("rows", list(rows), f"row indices in [0, {self.batch})")
        new = StaticKVCache.__new__(StaticKVCache)
        used = int(self._lengths.max()) if self.batch else 0
        # copy only the used prefix; the rest of the new cache is fresh space
        new.keys, new.values = [], []
        for k, v in zip(self.keys, self.values, strict=True):
            nk = k.new_zeros((len(index), *k.shape[1:]))
            nv = v.new_zeros((len(index), *v.shape[1:]))
            nk[:, :, :used] = k[index, :, :used]
            nv[:, :, :used] = v[index, :, :used]
            new.keys.append(nk)
            new.values.append(nv)
        new._lengths = self._lengths[index].clone()
        return new

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        new = torch.as_tensor(lengths, dtype=torch.long, device=self._lengths.device)
        if new.shape != self._lengths.shape or bool((new < 0).any()) or bool((new > self._lengths).any()):
            allowed = f"{self.batch} values in [0, current lengths {self._lengths.tolist()}]"
            raise InvalidParameter("lengths", new.tolist(), allowed)
        self._lengths = new.clone()

    # --- blocks, for the prefix cache (metaloom.prefix) ----------------------------------
    def read_block(self, row: int, start: int, end: int) -> torch.Tensor:
        """A copy of row ``row``'s keys and values at positions ``start .. end - 1``:
        [layers, 2, H_kv, end - start, D]."""
        if not 0 <= row < self.batch or not 0 <= start <= end <= int(self._lengths[row]):
            raise InvalidParameter("span", (row, start, end), f"a row in [0, {self.batch}) and 0 <= start <= end <= its length")
        return torch.stack([torch.stack((k[row, :, start:end], v[row, :, start:end]))
                            for k, v in zip(self.keys, self.values, strict=True)])

    def append_block(self, row: int, block: torch.Tensor) -> None:
        """Write ``block`` [layers, 2, H_kv, n, D] (from `read_block`) at row ``row``'s length
        and advance that row by ``n``; the positions are the row's, so RoPE stays consistent as
        long as the block was read from the same positions."""
        n = block.shape[3]
        if not 0 <= row < self.batch:
            raise InvalidParameter("row", row, f"a row in [0, {self.batch})")
        start = int(self._lengths[row])
        if start + n > self.capacity:
            raise CacheFull(f"KV cache row needs {start + n} positions but was allocated {self.capacity}")
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            k[row, :, start:start + n] = block[layer, 0]
            v[row, :, start:start + n] = block[layer, 1]
        self._lengths = self._lengths.clone()  # never mutate a lengths tensor a caller may hold
        self._lengths[row] += n
