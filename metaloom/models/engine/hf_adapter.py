"""Any transformers causal LM behind metaloom's `LanguageModel` / `KVCache` protocols.

The native model (`metaloom.models.engine.llama`) covers the families of
`metaloom.models.engine.config`; everything else (GPT-2, Falcon, StableLM, LFM2, Qwen3-MoE, a
GGUF of any architecture transformers' GGUF loader reads, …) runs through transformers' own
modelling code here, with the same semantics:
rows of a batch may hold different lengths, ``valid`` right-pads a forward, ``fork`` copies rows
and ``truncate`` rolls rows back — so decoders never know which backend they drive.

How rows of different lengths share one transformers ``DynamicCache``: every forward appends
all ``T`` tokens of every row physically, and `HFCache` keeps, per physical slot, whether the key
is real (``key_valid`` [B, S]). Padding and rolled-back slots are simply masked out forever; a
row's logical length is its count of valid slots, and positions are passed explicitly
(``position_ids = lengths + arange(T)``), so RoPE / learned positions see logical positions.
Keys are stored already rotated, so moving them physically (`HFCache._pack`) changes nothing.

Masks. Full attention only needs a 2D padding mask: transformers' causal rule runs on physical
slots, whose order within a row is the logical order. A sliding window cannot run on physical
slots (a hole would eat part of the window), so models with sliding layers get 4D masks built
here from logical positions (the valid-slot count before each slot), one per layer type.

Needs transformers >= 4.56 (``Cache.layers``); requires sdpa or eager attention for sliding models.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from metaloom.errors import CacheFull, ContextWindowExceeded, InvalidParameter, NotAModel, UnsupportedModel
from metaloom.models.protocols import KVCache

FULL, SLIDING = "full_attention", "sliding_attention"
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


class HFCache:
    """A transformers ``DynamicCache`` plus per-row bookkeeping: ``key_valid`` [B, S_physical]
    (True = a real key) and logical ``lengths`` [B]. Invariant: ``lengths[b] ==
    key_valid[b].sum()``, and the physical length of every layer equals ``S_physical``."""

    def __init__(self, batch: int, capacity: int, device: torch.device | str = "cpu") -> None:
        from transformers import DynamicCache

        # no config: every layer a full DynamicLayer, so sliding layers keep all keys and the
        # window is applied by our mask on logical positions
        self.kv = DynamicCache()
        self.key_valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self._lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self._capacity = capacity

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def batch(self) -> int:
        return self._lengths.shape[0]

    @property
    def physical_length(self) -> int:
        return self.key_valid.shape[1]

    def _layers(self) -> list[tuple[int, Any]]:
        """(index, layer) of the layers holding tensors (transformers creates layers lazily)."""
        return [(i, layer) for i, layer in enumerate(self.kv.layers) if getattr(layer, "keys", None) is not None]

    def reserve(self, new_tokens: int) -> None:
        """Raise `CacheFull` if the longest row would pass ``capacity``; repack first if the
        physical length would (holes from padding), so memory stays bounded by ``capacity``."""
        need = int(self._lengths.max()) + new_tokens if self.batch else new_tokens
        if need > self._capacity:
            raise CacheFull(f"KV cache needs {need} positions but was allocated {self._capacity}")
        if self.physical_length + new_tokens > self._capacity:
            self._pack()

    def appended(self, valid: torch.Tensor, new_tokens: int) -> None:
        """Record a forward that appended ``new_tokens`` slots per row, the first ``valid[b]`` real."""
        fresh = torch.arange(new_tokens, device=valid.device)[None, :] < valid[:, None]
        self.key_valid = torch.cat([self.key_valid, fresh], dim=1)
        self._lengths = self._lengths + valid
        held = self.kv.get_seq_length()
        if self.batch and held != self.physical_length:
            raise UnsupportedModel(f"the model's cache holds {held} positions where {self.physical_length} were "
                                   "appended; its cache layers are not plain append-only attention")

    @torch.inference_mode()
    def fork(self, rows: Sequence[int]) -> HFCache:
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self._lengths.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.batch):
            raise InvalidParameter("rows", list(rows), f"row indices in [0, {self.batch})")
        new = HFCache(len(index), self._capacity, self._lengths.device)
        for i, layer in self._layers():
            # index_select copies: the fork owns its tensors and never aliases this cache.
            # `update` with zero new slots creates the layer; assigning (not appending) the
            # copies avoids the second copy `update`'s concatenation would make.
            keys = layer.keys.index_select(0, index.to(layer.keys.device))
            values = layer.values.index_select(0, index.to(layer.values.device))
            new.kv.update(keys[:, :, :0], values[:, :, :0], i)
            target: Any = new.kv.layers[i]
            target.keys, target.values = keys, values
        new.key_valid = self.key_valid.index_select(0, index)
        new._lengths = self._lengths.index_select(0, index)
        if not bool(new.key_valid.all()):  # padding holes of the chosen rows: drop them now
            new._pack()
        return new

    @torch.inference_mode()
    def join(self, other: HFCache) -> HFCache:
        """This cache's rows, then ``other``'s (rows joining a running batch): the shorter
        physical side is padded with holes (invalid slots), then the layers are concatenated."""
        if not isinstance(other, HFCache):
            raise InvalidParameter("other", type(other).__name__, "an HFCache")
        width = max(self.physical_length, other.physical_length)
        new = HFCache(self.batch + other.batch, max(self._capacity, other._capacity), self._lengths.device)
        mine, theirs = dict(self._layers()), dict(other._layers())
        for i in sorted(set(mine) | set(theirs)):
            parts = []
            for cache, layers in ((self, mine), (other, theirs)):
                layer = layers.get(i)
                if layer is None:  # a side with no tensors yet (an empty cache)
                    like = (mine.get(i) or theirs[i]).keys
                    shape = (cache.batch, like.shape[1], width, like.shape[3])
                    parts.append((like.new_zeros(shape), like.new_zeros(shape)))
                    continue
                pad = width - layer.keys.shape[2]
                parts.append((torch.nn.functional.pad(layer.keys, (0, 0, 0, pad)),
                              torch.nn.functional.pad(layer.values, (0, 0, 0, pad))))
            keys = torch.cat([k for k, _ in parts])
            values = torch.cat([v for _, v in parts])
            new.kv.update(keys[:, :, :0], values[:, :, :0], i)
            target: Any = new.kv.layers[i]
            target.keys, target.values = keys, values
        valid = [torch.nn.functional.pad(c.key_valid, (0, width - c.physical_length), value=False) for c in (self, other)]
        new.key_valid = torch.cat(valid)
        new._lengths = torch.cat([self._lengths, other._lengths])
        return new

    @torch.inference_mode()
    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        new = torch.as_tensor(lengths, dtype=torch.long, device=self._lengths.device)
        if new.shape != self._lengths.shape or bool((new < 0).any()) or bool((new > self._lengths).any()):
            raise InvalidParameter("lengths", new.tolist(),
                                   f"{self.batch} values in [0, current lengths {self._lengths.tolist()}]")
        logical = self.key_valid.cumsum(dim=1) - 1
        self.key_valid = self.key_valid & (logical < new[:, None])
        self._lengths = new.clone()
        # crop the physical tail that no row uses any more (all rows rolled back past it)
        used = self.key_valid.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        if keep < self.physical_length:
            for _, layer in self._layers():
                layer.crop(keep - self.physical_length)
            self.key_valid = self.key_valid[:, :keep]

    @torch.inference_mode()
    def _pack(self) -> None:
        """Move each row's valid keys to slots ``0 .. lengths[b] - 1`` (stable, so order is
        kept); physical length becomes ``max(lengths)``."""
        width = int(self._lengths.max()) if self.batch else 0
        # stable sort of "is a hole": valid slots first, in their original order
        order = torch.sort((~self.key_valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for _, layer in self._layers():
            layer.keys = _gather_slots(layer.keys, order)
            layer.values = _gather_slots(layer.values, order)
        self.key_valid = torch.arange(width, device=self._lengths.device)[None, :] < self._lengths[:, None]


def _gather_slots(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D], order [B, S'] -> [B, H, S', D]: row b takes slots order[b]."""
    b, h, _, d = x.shape
    return torch.gather(x, 2, order.to(x.device)[:, None, :, None].expand(b, h, order.shape[1], d))


def _context_window(cfg: Any) -> int:
    for key in _CONTEXT_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise UnsupportedModel(f"the model config names no context window (looked for {', '.join(_CONTEXT_KEYS)})")


def _attention_kinds(cfg: Any) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer types that need their own 4D mask, sliding window), or (None, None) when a 2D
    padding mask is exact (full attention everywhere).

    transformers' conventions: hybrid models list ``layer_types`` and accept a dict of masks by
    type; models without ``layer_types`` but with ``sliding_window`` set (Mistral, Phi-3,
    Starcoder2 …) slide in every layer and take one mask."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        kinds = set(types)
        if kinds <= {FULL}:
            return None, None
        if kinds <= {FULL, SLIDING} and window is not None:
            return tuple(sorted(kinds)), int(window)
        raise UnsupportedModel(f"layer types {sorted(kinds)}: the transformers adapter supports "
                               f"{FULL!r} and {SLIDING!r} (with a sliding_window) only")
    if window is not None:
        return (SLIDING,), int(window)
    return None, None


class HFModel:
    """A transformers ``PreTrainedModel`` (causal LM) as a `LanguageModel`."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self._kinds, self._window = _attention_kinds(self.config)
        # a per-layer dict of masks only where the model lists layer types; else one tensor
        self._mask_dict = getattr(self.config, "layer_types", None) is not None
        self._attn = getattr(self.config, "_attn_implementation", None) or model.config._attn_implementation
        if self._kinds is not None and self._attn not in ("sdpa", "eager"):
            raise UnsupportedModel(f"attention implementation {self._attn!r} with sliding windows: the adapter "
                                   "builds 4D masks for 'sdpa' or 'eager' only")
        self._max_context = _context_window(self.config)
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        head = model.get_output_embeddings()
        self._vocab = int(head.weight.shape[0]) if head is not None else int(self.config.vocab_size)
        self._flop_dims = self._count_flop_dims(head)

    @classmethod
    def from_folder(cls, folder: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    attn_implementation: str | None = None) -> HFModel:
        """Load a transformers folder (``config.json`` + weights), local files only.
        ``attn_implementation`` (e.g. "eager") overrides transformers' choice (sdpa where supported)."""
        from transformers import AutoModelForCausalLM

        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **extra)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError … on a bad folder
            raise NotAModel(f"transformers cannot load {folder} as a causal LM: {' '.join(str(exc).split())}") from exc
        return cls(model.to(device))

    # --- protocol ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # tied weights counted once

    def new_cache(self, batch: int, capacity: int) -> HFCache:
        if batch < 0 or capacity < 0:
            raise InvalidParameter("batch, capacity", (batch, capacity), "non-negative integers")
        if capacity > self.max_context:
            raise ContextWindowExceeded(capacity, self.max_context, "the requested cache")
        return HFCache(batch, capacity, self.device)

    def _count_flop_dims(self, head: Any) -> tuple[int, int, int, int]:
        """(matmul weights per token, LM-head weights, layers, heads * head_dim)."""
        embeddings = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)}
        head_weight = head.weight if head is not None else None
        if head_weight is not None:
            embeddings.add(id(head_weight))
        # every >= 2-D weight except the embedding tables and the LM head is a per-token matmul;
        # 1-D tensors (norms, biases) are ignored, as in `metaloom.models.flops`
        body = sum(p.numel() for p in self.model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
        head_n = head_weight.numel() if head_weight is not None else self._vocab * self.config.hidden_size
        heads = self.config.num_attention_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // heads
        return body, head_n, self.config.num_hidden_layers, heads * head_dim

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        """The `metaloom.models.flops` count, with the weights counted from the model rather
        than from config fields, so it holds for any architecture (GPT-2's two-matrix MLP as
        well as gated ones): ``2 * W * new_tokens + 2 * V * d * logit_rows + 4 * L * H * D *
        attended``, W the >= 2-D weights outside embeddings and LM head. For the Llama family
        this equals `forward_flops` exactly. Sliding-window layers are charged as if they
        attended every key (an overestimate, as the native model does)."""
        body, head, layers, width = self._flop_dims
        return float(2 * body * new_tokens + 2 * head * logit_rows + 4 * layers * width * attended)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] ([B, 1, V] with ``last_only``); see `LanguageModel`."""
        if not isinstance(cache, HFCache):
            raise InvalidParameter("cache", type(cache).__name__, "an HFCache from this model's new_cache")
        if tokens.dim() != 2 or tokens.shape[0] != cache.batch:
            raise InvalidParameter("tokens", tuple(tokens.shape), f"[{cache.batch}, T] (the cache's batch)")
        b, t = tokens.shape
        if valid is None:
            valid = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        valid = valid.to(device=cache.lengths.device, dtype=torch.long)
        if valid.shape != (b,) or bool((valid < 0).any()) or bool((valid > t).any()):
            raise InvalidParameter("valid", valid.tolist(), f"{b} counts in [0, {t}]")
        cache.reserve(t)
        positions = cache.lengths[:, None] + torch.arange(t, device=cache.lengths.device)  # [B, T]
        # new slots count as keys during this forward (a padded query then still sees itself,
        # never a fully masked row); valid queries cannot see later padded ones (causal)
        keys_valid = torch.cat([cache.key_valid, torch.ones(b, t, dtype=torch.bool, device=positions.device)], 1)
        mask = self._masks(keys_valid, cache.key_valid, positions) if self._kinds else keys_valid.long()
        extra: dict[str, Any] = {}
        last = valid - 1  # valid == 0 reads the last position, like the native model
        if last_only and self._keep_arg:
            keep = torch.unique(last)  # sorted; transformers keeps these positions for every row
            extra["logits_to_keep"] = keep
            column = torch.searchsorted(keep, last)
        else:
            column = last
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                         past_key_values=cache.kv, use_cache=True, **extra)
        if out.past_key_values is not cache.kv:
            raise UnsupportedModel(f"{type(self.model).__name__} replaced the cache object it was given")
        cache.appended(valid, t)
        logits = out.logits
        if last_only:
            logits = logits[torch.arange(b, device=logits.device), column.to(logits.device)][:, None]
        return logits

    def _masks(self, keys_valid: torch.Tensor, old_valid: torch.Tensor, positions: torch.Tensor) -> Any:
        """4D masks [B, 1, T, S + T] on logical positions, per layer type (or one tensor)."""
        key_pos = torch.cat([old_valid.cumsum(dim=1) - 1, positions], dim=1)[:, None, :]  # [B, 1, S + T]
        query_pos = positions[:, :, None]  # [B, T, 1]
        causal = keys_valid[:, None, :] & (key_pos <= query_pos)
        masks = {}
        for kind in self._kinds or ():
            allowed = causal if kind == FULL else causal & (key_pos > query_pos - int(self._window or 0))
            masks[kind] = self._format(allowed[:, None])
        return masks if self._mask_dict else masks[SLIDING]

    def _format(self, allowed: torch.Tensor) -> torch.Tensor:
        if self._attn == "sdpa":
            return allowed  # SDPA takes a boolean mask, True = attend
        # eager attention adds the mask to the scores
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)
