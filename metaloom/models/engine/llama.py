"""Native Llama-family model (Llama, SmolLM2, Qwen2 with qkv bias, Mistral).

Plain tensors and `torch.nn.functional`, no `nn.Module` tree: at batch 1 on a CPU the per-op
overhead is a large share of a decode step, so q/k/v and gate/up are fused into one matmul
each and one attention mask per forward is shared by all layers. One-token steps on the CPU
(float32, bfloat16) go further when the model was given `metaloom.models.kernels.fused` kernels:
everything between the matmuls runs in three C calls per layer (`LlamaModel._step_fused`), and
so does a speculative verify of a few tokens per row, each token a row of its own
(`LlamaModel._verify_fused`); prefill takes the PyTorch ops below. Keys and values live in a KV pool
of token slots shared by the caches made from it (`metaloom.models.engine.cache`): a forked row reads
its parent's keys where they are.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from metaloom.errors import ContextWindowExceeded, InvalidParameter, NotAModel, UnsupportedModel
from metaloom.models.engine import dropping, graphs
from metaloom.models.engine.cache import KVPool, PagedKVCache, storage_dtype
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.graphs import StepGraphs
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.rope import apply_rope, rope_tables
from metaloom.models.engine.sharing import Sharing, find_sharing
from metaloom.models.engine.stack import Plan, pointers
from metaloom.models.engine.stack import plan as stack_plan
from metaloom.models.flops import forward_flops
from metaloom.models.kernels import quant
from metaloom.models.kernels.fused import PARALLEL_MIN_KEYS, Drops, FusedKernels, unsupported_reason
from metaloom.models.kernels.packed import Bf16Linear, PackedLinear, own_bf16, pack
from metaloom.models.protocols import KVCache

# shared-prefix attention's ``auto``: on when a step's rows share at least this many key reads
# per layer and kv head (the sum over shared spans of (rows - 1) x span length); below it the
# per-row kernel is as fast (measured: `metaloom bench fork --case shared`)
AUTO_SHARED_READS = 4096
# the widest block a row may take through the fused kernels as a verify (`LlamaModel._verify_fused`):
# a pending token and up to 64 drafted ones (metaloom.speculative.drafter.MAX_DRAFT); wider blocks
# are prefills, where PyTorch's fused attention over the whole block is the faster path
FUSED_VERIFY_WIDTH = 65


class MatMul(Protocol):
    """A weight that multiplies by itself, x [..., in] -> [..., out] (e.g. the quantised
    `metaloom.models.kernels.quant.QuantWeight`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...  # the parameters it stands for (out x in)


class RowTable(Protocol):
    """An embedding table that is not a plain tensor (quantised blocks): rows looked up by id."""

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...  # ids [...] -> [..., d]

    def numel(self) -> int: ...


Weight = torch.Tensor | MatMul
Embedding = torch.Tensor | RowTable


def embed_tokens(table: Embedding, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tokens [...] -> vectors [..., d] in ``dtype``, a fresh tensor (the residual stream)."""
    if isinstance(table, torch.Tensor):
        return F.embedding(tokens, table)
    return table.rows(tokens, dtype)


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    qkv: Weight  # [(H + 2 H_kv) D, d]
    qkv_bias: torch.Tensor | None
    o: Weight  # [d, H D]
    mlp_norm: torch.Tensor
    gate_up: Weight  # [2 I, d]
    down: Weight  # [d, I]


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in].T (+ bias), by the kernel that is fastest here.

    - a `MatMul` (not a tensor) multiplies by itself: a quantised weight, or a
      `metaloom.models.kernels.packed.PackedLinear` (the CPU default, see `LlamaModel.packed`);
    - a single row goes through `torch.mv`: in bfloat16 the GEMM path is several times slower
      for one row (0.9 vs 20 GB/s, measured), and `mv` over [out, in] is the fastest bfloat16
      kernel here;
    - several rows: `F.linear`.

    Weights stay [out, in] row-major. Stored transposed ([in, out]), one float32 row multiplies
    faster on this CPU (16-22 against 9-14 GB/s), but 2-64 rows (verify, prefill, batches)
    multiply 1.4-2x slower (measured side by side), so the layout was tried and dropped.
    """
    if not isinstance(w, torch.Tensor):
        y = w(x)
        return y if bias is None else y + bias
    if x.numel() == x.shape[-1]:
        y = torch.mv(w, x.reshape(-1)).view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def plain_weight(w: Weight) -> Weight:
    """The plain tensor behind a packed weight; any other weight as it is."""
    return w.weight if isinstance(w, (PackedLinear, Bf16Linear)) else w


def dense_weight(w: Weight) -> torch.Tensor:
    """The plain [out, in] tensor of a plain or packed weight (a quantised one has none)."""
    w = plain_weight(w)
    if not isinstance(w, torch.Tensor):
        raise UnsupportedModel(f"a {type(w).__name__} weight has no plain tensor")
    return w


@dataclass(frozen=True, eq=False)
class Concat:
    """Weights stacked along their outputs that cannot be one tensor: quantised parts of
    different types (a GGUF may keep v in Q8_0 beside q and k in Q5_0). A `MatMul`."""

    parts: tuple[Weight, ...]

    def numel(self) -> int:
        return sum(p.numel() for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x, p) for p in self.parts], dim=-1)


def panelled(w: Weight) -> Weight:
    """``w`` with its quantised parts in the panel layout where the kernels have one
    (`metaloom.models.kernels.quant.QuantWeight.panelled`); anything else as it is."""
    if isinstance(w, Concat):
        return Concat(tuple(panelled(p) for p in w.parts))
    panel = getattr(w, "panelled", None)
    return panel() if callable(panel) else w


def stack(ws: list[Weight]) -> Weight:
    """One weight whose outputs are ``ws``'s outputs in order (q, k, v into qkv; gate, up)."""
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat(ws).contiguous()  # type: ignore[arg-type]  # all tensors, checked
    from metaloom.models.kernels.quant import QuantWeight

    if all(isinstance(w, QuantWeight) for w in ws):
        same = {(w.qtype, w.in_features) for w in ws}  # type: ignore[union-attr]
        if len(same) == 1:
            return QuantWeight.cat(ws)  # type: ignore[arg-type]  # all QuantWeights, checked
    return Concat(tuple(ws))


class LlamaModel:
    host_valid = True  # forward takes ``valid`` on the host too (the static step reads it there)

    def __init__(self, config: LlamaConfig, embed: Embedding, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Weight, fused: FusedKernels | None = None,
                 options: EngineOptions | None = None) -> None:
        """``fused``: the CPU kernels for one-token steps (`metaloom.models.kernels.fused`), or None for
        PyTorch ops only; an `UnsupportedModel` error says why a model cannot take them.
        ``options``: how the KV cache is held and read (`metaloom.models.engine.options`). The
        activations' dtype and device are the final norm's (the embedding and the linear weights
        may be quantised blocks, `metaloom.models.engine.native`)."""
        if fused is not None and (why := unsupported_reason(config, norm.dtype, norm.device)) is not None:
            raise UnsupportedModel(why)
        self.config = config
        self.fused = fused
        self.options = options or EngineOptions()
        if self.options.drops and config.sliding_window is not None:
            raise InvalidParameter("kv_policy", self.options.kv_policy,
                                   f"'full' for a model with a sliding window ({config.sliding_window} tokens): its "
                                   "window counts positions, which a row that dropped some no longer holds in order")
        self.embed = embed
        # quantised weights in the layout their batch-1 kernels read fastest (quant.c's panels)
        self.layers = [replace(w, qkv=panelled(w.qkv), o=panelled(w.o), gate_up=panelled(w.gate_up),
                                           down=panelled(w.down)) for w in layers]
        self.norm = norm
        self.lm_head = panelled(lm_head)
        self.dtype = norm.dtype
        self._plans: dict[str, Plan | None] = {}  # metaloom.models.engine.stack, per quantised-kernel library
        self._graphs: weakref.WeakKeyDictionary[KVPool, StepGraphs] = weakref.WeakKeyDictionary()  # per pool
        self._cos, self._sin = rope_tables(config.head_dim, config.rope_theta, config.rope_scaling_dict,
                                           config.max_position_embeddings, self.dtype, norm.device)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: LlamaConfig, sd: Mapping[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        blocks: Mapping[str, MatMul] | None = None) -> LlamaModel:
        """Build from transformers-named weights (``model.layers.0.self_attn.q_proj.weight`` …).
        ``blocks``: weights kept quantised (`metaloom.models.engine.native`), by the same names; they
        stand in for ``sd``'s tensors of those names (an embedding among them must also look up
        rows, a `RowTable`)."""
        kept = blocks or {}

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise NotAModel(f"weights are missing tensor {name!r}")
            return sd[name].to(device=device, dtype=dtype)

        def weight(name: str) -> Weight:
            return kept[name] if name in kept else get(name)

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            layers.append(LayerWeights(
                attn_norm=get(p + "input_layernorm.weight"),
                qkv=stack([weight(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                qkv_bias=bias,
                o=weight(p + "self_attn.o_proj.weight"),
                mlp_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=stack([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")]),
                down=weight(p + "mlp.down_proj.weight"),
            ))
        name = "model.embed_tokens.weight"
        embed: Embedding
        if name in kept:
            table = kept[name]
            if not hasattr(table, "rows"):
                raise UnsupportedModel(f"the kept embedding {type(table).__name__} cannot look up rows")
            embed = table  # type: ignore[assignment]  # checked just above: it has rows()
        else:
            embed = get(name)
        shape = tuple(getattr(embed, "shape", ()))
        if shape != (config.vocab_size, config.hidden_size):
            raise NotAModel(f"embedding shape {shape} does not match the config "
                            f"({config.vocab_size}, {config.hidden_size})")
        tied = config.tie_word_embeddings or ("lm_head.weight" not in sd and "lm_head.weight" not in kept)
        head: Weight = embed if tied else weight("lm_head.weight")  # type: ignore[assignment]  # a tied table is a weight
        return cls(config, embed, layers, get("model.norm.weight"), head)

    def packed(self) -> LlamaModel:
        """The same model with its linear weights also in the CPU GEMM libraries' packed layouts
        (`metaloom.models.kernels.packed`: faster one-row decode and k-row verify, more memory)."""
        if type(self) is not LlamaModel:
            raise UnsupportedModel(f"packing is for plain LlamaModel weights, not {type(self).__name__}")

        def p(w: Weight) -> Weight:
            return pack(w) if isinstance(w, torch.Tensor) else w

        layers = [replace(w, qkv=p(w.qkv), o=p(w.o), gate_up=p(w.gate_up), down=p(w.down)) for w in self.layers]
        return LlamaModel(self.config, self.embed, layers, self.norm, p(self.lm_head), self.fused, self.options)

    def own_bf16(self) -> LlamaModel:
        """The same model with its bfloat16 linear weights multiplied by metaloom's own bfloat16
        kernel (`metaloom.models.kernels.packed.Bf16Linear`: the same storage, no copy), for CPUs where
        oneDNN has no bfloat16 kernels and PyTorch's are slower than float32."""
        if type(self) is not LlamaModel:
            raise UnsupportedModel(f"own_bf16 is for plain LlamaModel weights, not {type(self).__name__}")

        def p(w: Weight) -> Weight:
            ok = isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.shape[1] % 32 == 0
            return own_bf16(w) if ok else w  # type: ignore[arg-type]  # a tensor, checked

        layers = [replace(w, qkv=p(w.qkv), o=p(w.o), gate_up=p(w.gate_up), down=p(w.down)) for w in self.layers]
        return LlamaModel(self.config, self.embed, layers, self.norm, p(self.lm_head), self.fused, self.options)

    def with_fused(self, fused: FusedKernels | None) -> LlamaModel:
        """The same weights, taking one-token steps through ``fused`` (None: PyTorch ops only)."""
        if type(self) is not LlamaModel:
            raise UnsupportedModel(f"with_fused is for plain LlamaModel weights, not {type(self).__name__}")
        return LlamaModel(self.config, self.embed, self.layers, self.norm, self.lm_head, fused, self.options)

    def with_options(self, options: EngineOptions) -> LlamaModel:
        """The same weights, holding and reading the KV cache as ``options`` say."""
        if type(self) is not LlamaModel:
            raise UnsupportedModel(f"with_options is for plain LlamaModel weights, not {type(self).__name__}")
        return LlamaModel(self.config, self.embed, self.layers, self.norm, self.lm_head, self.fused, options)

    def linear_weight_bytes(self) -> int:
        """Bytes of the plain linear weights (what packing copies)."""
        ws = [plain_weight(w) for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(w.numel() * w.element_size() for w in [*ws, plain_weight(self.lm_head)] if isinstance(w, torch.Tensor))

    # --- protocol ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if plain_weight(self.lm_head) is not self.embed:
            n += self.lm_head.numel()
        for w in self.layers:
            n += sum(t.numel() for t in (w.attn_norm, w.qkv, w.o, w.mlp_norm, w.gate_up, w.down))
            n += w.qkv_bias.numel() if w.qkv_bias is not None else 0
        return n

    @property
    def kv_dtype(self) -> torch.dtype:
        """What this model's KV pools store (``options.kv_dtype``; ``auto``: the activations' dtype)."""
        return storage_dtype(self.options.kv_dtype, self.dtype)

    def new_pool(self, slots: int = 256, max_slots: int | None = None) -> KVPool:
        """Empty KV memory for this model's caches (`metaloom.models.engine.cache`): caches made from
        one pool share keys and values without copying them. Stored as ``options.kv_dtype`` says,
        read in the model's dtype."""
        c = self.config
        return KVPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype, self.device,
                      slots=slots, max_slots=max_slots, compute_dtype=self.dtype)

    def new_cache(self, batch: int, capacity: int, pool: KVPool | None = None) -> PagedKVCache:
        """``batch`` empty rows of up to ``capacity`` positions, in ``pool`` (default: a pool of
        their own, sized for them)."""
        if capacity > self.max_context:
            raise ContextWindowExceeded(capacity, self.max_context, "the requested cache")
        c = self.config
        if pool is None:
            pool = self.new_pool(slots=max(2, batch * capacity + 1))
        elif (pool.layers, pool.kv_heads, pool.head_dim, pool.dtype, pool.compute_dtype) != (
                c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.kv_dtype, self.dtype):
            raise InvalidParameter("pool", (pool.layers, pool.kv_heads, pool.head_dim, pool.dtype, pool.compute_dtype),
                                   "a KV pool of this model's shape and kv dtype (model.new_pool())")
        return PagedKVCache(pool, batch, capacity)

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        c = self.config
        return forward_flops(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                             kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                             intermediate=c.intermediate_size, vocab=c.vocab_size,
                             new_tokens=new_tokens, attended=attended, logit_rows=logit_rows)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False, tree: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] ([B, 1, V] with ``last_only``); see `LanguageModel`.
        ``tree`` [B, T, T] bool: the block is a token tree (speculative verification,
        `metaloom.speculative.tree`): token i attends the cache and the block's tokens j with
        ``tree[b, i, j]`` (itself and its ancestors), at position length + its depth."""
        static = self._static_step(tokens, cache, valid, last_only, tree)
        if static is not None:
            return static[0]
        valid = None if valid is None else valid.to(tokens.device)
        return linear(self._hidden(tokens, cache, valid, last_only, tree), self.lm_head)

    @torch.inference_mode()
    def forward_hidden(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                       last_only: bool = False, tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` that also returns the final hidden states: (logits [B, T, V], hidden [B, T, d]),
        hidden after the last norm, what the LM head reads (speculator heads draft from them)."""
        static = self._static_step(tokens, cache, valid, last_only, tree)
        if static is not None:
            return static
        valid = None if valid is None else valid.to(tokens.device)
        x = self._hidden(tokens, cache, valid, last_only, tree)
        return linear(x, self.lm_head), x

    def step_graphs(self, pool: KVPool) -> StepGraphs | None:
        """The static one-token steps over ``pool`` (`metaloom.models.engine.graphs`) that
        METALOOM_CUDA_GRAPHS allows here: captured on CUDA (auto, on), uncaptured on the CPU
        (on only); None where they are off or this model cannot take them."""
        chosen = graphs.mode()
        cuda = self.device.type == "cuda"
        if chosen == "off" or (chosen == "auto" and not cuda) or graphs.why_not(self, pool) is not None:
            return None
        with pool.lock:  # one runner a pool, also when two threads ask at once
            runner = self._graphs.get(pool)
            if runner is None:
                runner = self._graphs[pool] = StepGraphs(self, pool, capture=cuda)
        return runner

    def step_graph_stats(self) -> dict[str, int | list[str]]:
        """What the static steps did, summed over this model's pools: graphs captured and
        replayed, static steps run, whole-table uploads, and why any capture failed."""
        runners = list(self._graphs.values())
        out: dict[str, int | list[str]] = {k: sum(getattr(r, k) for r in runners)
                                           for k in ("captures", "replays", "steps", "uploads", "triton_steps")}
        out["failures"] = [r.failure for r in runners if r.failure is not None]
        out["triton_failures"] = [r.triton_failure for r in runners if r.triton_failure is not None]
        return out

    def _static_step(self, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                     last_only: bool = False, tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [B, T, V], hidden [B, T, d]) of a decode step (T = 1) or a speculative verify
        (T <= MAX_WIDTH over rows that hold keys already) through `step_graphs`, or None when
        this forward is neither (the caller takes the eager path)."""
        b, t = tokens.shape
        if b == 0 or graphs.row_bucket(b) is None or not isinstance(cache, PagedKVCache) or t > graphs.MAX_WIDTH:
            return None
        if cache.pool.layers != len(self.layers) or b != cache.batch or (t > 1 and not cache.host_lengths().all()):
            return None  # a prefill of fresh rows takes the eager path (PyTorch's fused attention)
        if tree is not None and (t == 1 or tuple(tree.shape) != (b, t, t) or tree.dtype != torch.bool
                                 or self.config.sliding_window is not None or self.options.drops):
            return None  # the eager path checks the tree (a typed error) or takes it
        runner = self.step_graphs(cache.pool)
        if runner is None:
            return None
        keep = [t] * b if valid is None else valid.tolist()
        logits, hidden = runner.run(tokens, cache, keep, None if tree is None else tree.to(tokens.device))
        if last_only:
            last = torch.as_tensor([max(k, 1) - 1 for k in keep], device=logits.device)
            index = torch.arange(b, device=logits.device)
            return logits[index, last][:, None], hidden[index, last][:, None]
        return logits, hidden

    def _hidden(self, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                last_only: bool, tree: torch.Tensor | None = None) -> torch.Tensor:
        """The transformer up to and including the final norm: [B, T, d] (or [B, 1, d])."""
        if not isinstance(cache, PagedKVCache) or cache.pool.layers != len(self.layers):
            raise InvalidParameter("cache", type(cache).__name__, "a PagedKVCache from this model's new_cache()")
        c = self.config
        b, t = tokens.shape
        if b != cache.batch:
            raise InvalidParameter("tokens", tuple(tokens.shape), f"a batch of {cache.batch} rows (the cache's)")
        if valid is None:
            valid = torch.full((b,), t, dtype=torch.long, device=tokens.device)
        opts = self.options
        if tree is not None and (tuple(tree.shape) != (b, t, t) or tree.dtype != torch.bool):
            raise InvalidParameter("tree", tuple(tree.shape), f"a [{b}, {t}, {t}] bool mask (the block's tree)")
        if tree is not None and (opts.drops or self.config.sliding_window is not None):
            raise InvalidParameter("tree", "a token tree", "a model with no sliding window and --kv-policy 'full'")
        if t == 1:  # a tree of the pending token alone (nothing drafted): the one-token step, bit for bit
            tree = None
        if opts.drops:  # --kv-policy: rows past the budget drop positions first (metaloom.models.engine.dropping)
            dropping.before_forward(opts, cache, valid.cpu().numpy())
        lengths = cache.lengths  # before this forward
        slots = cache.prepare(valid.tolist(), t)  # [B, T]: where the new keys and values go
        if t == 1 and tree is None and self.fused is not None and b > 0 and self.fused_reads(cache.pool):
            y = self._step_fused(tokens, cache, lengths, valid, self.fused)
            if opts.drops:
                dropping.after_forward(opts, cache, 1, None)
            return y
        if self._verify_applies(cache, t, tree):
            assert self.fused is not None  # checked by _verify_applies
            return self._verify_fused(tokens, cache, valid, tree, last_only, self.fused)
        uniform = bool((lengths == lengths[0]).all()) if b else True
        fresh = uniform and (not b or int(lengths[0]) == 0)  # nothing cached: attend to this forward's keys
        entries = lengths[:, None] + torch.arange(t, device=tokens.device)  # [B, T]: where each token sits in its row
        # its position: the entry plus the positions the row dropped (--kv-policy), which RoPE sees
        positions = entries + torch.from_numpy(cache.shift).to(tokens.device)[:, None] if cache.drops else entries
        keys_len = int(lengths.max()) + t
        mask: torch.Tensor | None
        if tree is not None:  # a token tree: each token one past its parent, attending its ancestors
            positions = lengths[:, None] + tree.sum(-1) - 1
            mask, causal = self._tree_mask(lengths, tree, keys_len), False
        else:
            mask, causal = self._mask(entries, keys_len, uniform)
        cos = self._cos[positions][:, None]  # [B, 1, T, D]
        sin = self._sin[positions][:, None]
        run = None if fresh else cache.run_start(keys_len)  # one row in one run of slots: read in place
        # rows that dropped positions with sinks (StreamingLLM), or attention to record (H2O,
        # SnapKV's prompt): attention written out (dropping.attend) instead of SDPA
        mass = dropping.needs_mass(opts, t) if opts.drops else None
        sinks = bool(cache.sinks.any()) and cache.drops
        explicit = mass is not None or sinks
        if explicit:
            into = torch.zeros(b, keys_len, dtype=torch.float32, device=tokens.device) if mass else None
            sink_counts = torch.from_numpy(cache.sinks).to(tokens.device)
            cos_in, sin_in = (self._cos[entries][:, None], self._sin[entries][:, None]) if sinks else (None, None)

        x = embed_tokens(self.embed, tokens, self.dtype)  # [B, T, d]
        h, hk, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        for i, w in enumerate(self.layers):
            y = F.rms_norm(x, (c.hidden_size,), w.attn_norm, c.rms_norm_eps)
            qkv = linear(y, w.qkv, w.qkv_bias).view(b, t, h + 2 * hk, d).transpose(1, 2)
            # one RoPE call for q and k together (half the small ops of two calls)
            q, k = apply_rope(qkv[:, :h + hk], cos, sin).split([h, hk], dim=1)  # [B, heads, T, D]
            v = qkv[:, h + hk:]
            cache.write(i, k, v, slots)
            keys, values = (k, v) if fresh else cache.gather(i, keys_len, run)
            if explicit:
                q_in = None if cos_in is None else apply_rope(qkv[:, :h], cos_in, sin_in)  # type: ignore[arg-type]
                attn = dropping.attend(q, q_in, keys, values, entries, sink_counts, valid, mass, into)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=hk != h)
            x = x + linear(attn.transpose(1, 2).reshape(b, t, h * d), w.o)
            y = F.rms_norm(x, (c.hidden_size,), w.mlp_norm, c.rms_norm_eps)
            gate, up = linear(y, w.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w.down)
        cache.advance(valid)
        if opts.drops:
            votes = None
            if mass == "all":
                cache.attention_mass()[:, :keys_len] += into.cpu().double().numpy()  # type: ignore[union-attr]
            elif mass == "window":
                votes = into.cpu().double().numpy()  # type: ignore[union-attr]
            dropping.after_forward(opts, cache, t, votes)
        if last_only:
            x = x[torch.arange(b, device=x.device), valid - 1][:, None]
        return F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)

    def fused_reads(self, pool: KVPool) -> bool:
        """Whether the fused kernels read ``pool`` as it stores keys: a pool of the model's dtype,
        or an int8 one (codes and scales, read and written in C). A float pool of another type
        (``--kv-dtype bfloat16`` under a float32 model) takes the PyTorch ops' one-token step,
        which converts on write and read."""
        return pool.compute_dtype == self.dtype and pool.dtype in (self.dtype, torch.int8)

    def _step_fused(self, tokens: torch.Tensor, cache: PagedKVCache, lengths: torch.Tensor, valid: torch.Tensor,
                    k: FusedKernels) -> torch.Tensor:
        """`_hidden` for one new token per row through the fused kernels (`metaloom.models.kernels.fused`):
        the same arithmetic, three kernel calls and four matmuls per layer. The new position's
        slot is already in the cache's table (`PagedKVCache.prepare`). -> [B, 1, d]"""
        table = cache.table()
        drops = self._drops(cache, table.shape[1])
        sharing = None if drops.sinks is not None or drops.probs is not None else self._sharing(cache)
        y = self._fused_rows(tokens[:, 0], lengths.contiguous(), table, cache.pool, sharing, drops, k)
        if drops.probs is not None:  # H2O: each entry's attention this step, summed over heads and layers
            cache.attention_mass()[:, :table.shape[1]] += drops.probs.sum(1).double().numpy()
        cache.advance(valid)
        return y[:, None]

    def _fused_rows(self, tokens: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, pool: KVPool,
                    sharing: Sharing | None, drops: Drops, k: FusedKernels) -> torch.Tensor:
        """One new token per row through the fused kernels: tokens [R] at positions lengths [R],
        each row's slots table [R, width] (its new slot at its length). -> [R, d] after the final
        norm. A row's arithmetic does not depend on the other rows (the quantised matmuls keep
        rows apart, attention is per row) unless ``sharing`` merges their shared keys' parts."""
        c = self.config
        b, h = tokens.shape[0], c.num_attention_heads
        x = embed_tokens(self.embed, tokens, self.dtype)  # [R, d], a fresh tensor: the residual stream
        y = torch.empty_like(x)
        attn = x.new_empty(b, h * c.head_dim)
        act = x.new_empty(b, c.intermediate_size)
        if not self.fused_reads(pool) or not pool.keys[0].is_contiguous() or not table.is_contiguous():
            raise UnsupportedModel("the fused step needs the contiguous KV pool of new_cache()")
        # split attention over threads only when there is enough of it (each parallel region
        # costs a few microseconds, 2 per layer)
        threads = torch.get_num_threads() if b * (int(lengths.max()) + 1) >= PARALLEL_MIN_KEYS else 1
        plan = self._plan(b)
        if plan is not None:  # every layer in one call: the same kernels, in the same order (metaloom.models.engine.stack)
            delta = self._step_stack(plan, k, x, y, attn, act, lengths, table, pool, threads, sharing, drops)
        else:
            delta = None  # the last sublayer's output, added to x by the next norm
            for i, w in enumerate(self.layers):
                k.residual_rms_norm(x, delta, w.attn_norm, y, c.rms_norm_eps)
                qkv = linear(y, w.qkv, w.qkv_bias).contiguous()
                scales = (pool.key_scales[i], pool.value_scales[i]) if pool.quantized else None
                k.rope_attend(qkv, self._cos, self._sin, lengths, table, pool.keys[i], pool.values[i], attn, h,
                              c.sliding_window, threads, sharing, scales, drops)
                k.residual_rms_norm(x, linear(attn, w.o).contiguous(), w.mlp_norm, y, c.rms_norm_eps)
                k.silu_mul(linear(y, w.gate_up).contiguous(), act)
                delta = linear(act, w.down).contiguous()
        k.residual_rms_norm(x, delta, self.norm, y, c.rms_norm_eps)
        return y

    def _verify_applies(self, cache: PagedKVCache, t: int, tree: torch.Tensor | None) -> bool:
        """Whether a block of ``t`` tokens per row takes `_verify_fused`: the fused kernels read
        this pool, every row already holds keys (a fresh prompt is a prefill), the block is at
        most `FUSED_VERIFY_WIDTH` wide, and no row drops positions (``--kv-policy``); a sliding
        window only for a chain (its window is per position, which a tree's depths are not)."""
        return (1 < t <= FUSED_VERIFY_WIDTH and self.fused is not None and cache.batch > 0
                and self.fused_reads(cache.pool) and not self.options.drops
                and (tree is None or self.config.sliding_window is None) and bool(cache.host_lengths().all()))

    def _verify_fused(self, tokens: torch.Tensor, cache: PagedKVCache, valid: torch.Tensor,
                      tree: torch.Tensor | None, last_only: bool, k: FusedKernels) -> torch.Tensor:
        """`_hidden` for a block of a few tokens per row over rows that hold keys (a speculative
        verify: the pending token and the drafts, as a chain or a token tree) through the
        one-token fused kernels. Each kept token is a row of its own, at its position (length +
        depth), whose slot table is its row's cached slots followed by the new slots of its
        ancestors and its own; fused.c writes every row's new key before any row attends, so a
        token attends the ancestors written in the same call.

        Why: on the PyTorch ops a 2-token verify of SmolLM2 (native float32, after 400 tokens)
        cost 15.6 ms against a one-token step's 7.0, most of the difference dispatch and SDPA
        with a mask rather than arithmetic; here it costs 10.3 (scripts/verify_cost.py). A
        token's arithmetic is exactly a one-token step's (the quantised matmuls keep rows apart,
        and attention is per row), so a greedy verify's argmaxes are plain greedy's bits, not
        only to rounding, unless shared-prefix attention merges the tokens' shared keys (its
        ``auto`` mode, past `AUTO_SHARED_READS`: over a long prompt the tokens then read it once,
        not once each, which is worth the rounding: 3.4x faster at 4,000 positions and 21
        tokens, scripts/verify_cost.py). -> [B, T, d] ([B, 1, d] with ``last_only``), zeros at padding."""
        b, t = tokens.shape
        n = cache.host_lengths()  # before this forward: row b's block has slots at n[b] .. n[b] + valid[b] - 1
        keep = valid.tolist()
        rows_b = np.repeat(np.arange(b), keep)
        rows_i = np.concatenate([np.arange(v) for v in keep]) if b else np.zeros(0, dtype=np.int64)
        out = torch.zeros(b, t, self.config.hidden_size, dtype=self.dtype, device=tokens.device)
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
            sharing = self._sharing_of(table, lengths)
            y = self._fused_rows(tokens[torch.from_numpy(rows_b), torch.from_numpy(rows_i)],
                                 torch.from_numpy(lengths), torch.from_numpy(table), cache.pool, sharing, Drops(), k)
            out[torch.from_numpy(rows_b), torch.from_numpy(rows_i)] = y
        cache.advance(valid)
        if last_only:
            out = out[torch.arange(b), valid - 1][:, None]
        return out

    def _drops(self, cache: PagedKVCache, width: int) -> Drops:
        """What the fused kernels need of rows that dropped positions (``--kv-policy``): each
        row's shift, its sinks (StreamingLLM), a buffer for H2O's attention probabilities."""
        shift = torch.from_numpy(cache.shift) if cache.drops else None
        sinks = torch.from_numpy(cache.sinks) if shift is not None and cache.sinks.any() else None
        probs = None
        if self.options.kv_policy == "h2o":
            probs = torch.zeros(cache.batch, self.config.num_key_value_heads, width, dtype=torch.float32)
        return Drops(shift, sinks, probs)

    def _step_stack(self, plan: Plan, k: FusedKernels, x: torch.Tensor, y: torch.Tensor, attn: torch.Tensor,
                    act: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, pool: KVPool,
                    threads: int, sharing: Sharing | None = None, drops: Drops | None = None) -> torch.Tensor:
        """`_step_fused`'s layers in one C call (fused.c's ``decode_layers``), on the same buffers;
        -> the last sublayer's output (x is the residual stream before it, as the loop leaves it)."""
        c = self.config
        b, h, hk = x.shape[0], c.num_attention_heads, c.num_key_value_heads
        delta = torch.empty_like(x)
        qkv = x.new_empty(b, (h + 2 * hk) * c.head_dim)
        gu = x.new_empty(b, 2 * c.intermediate_size)
        rc = k.lib.decode_layers(plan.layers, plan.count, x.data_ptr(), delta.data_ptr(), y.data_ptr(), qkv.data_ptr(),
                                 attn.data_ptr(), gu.data_ptr(), act.data_ptr(), self._cos.data_ptr(),
                                 self._sin.data_ptr(), lengths.data_ptr(), table.data_ptr(), table.shape[1],
                                 pointers(pool.keys), pointers(pool.values), b, c.hidden_size, h, hk, c.head_dim,
                                 c.intermediate_size, c.sliding_window or 0, threads, torch.get_num_threads(),
                                 c.rms_norm_eps, self.dtype == torch.bfloat16,
                                 None if sharing is None else ctypes.byref(sharing.desc),
                                 pointers(pool.key_scales) if pool.quantized else None,
                                 pointers(pool.value_scales) if pool.quantized else None,
                                 *(drops or Drops()).pointers())
        if rc:
            raise RuntimeError(f"decode_layers failed with code {rc}")  # the plan's shapes were checked: a bug
        return delta

    def _sharing(self, cache: PagedKVCache) -> Sharing | None:
        """The positions this step's rows share in the pool, for shared-prefix attention
        (`metaloom.models.engine.sharing`), or None: turned off, a sliding window (its rows
        attend different spans), nothing shared, or (``auto``) too little shared to gain."""
        return self._sharing_of(cache.slots, cache.host_lengths())

    def _sharing_of(self, slots: np.ndarray, lengths: np.ndarray) -> Sharing | None:
        """`_sharing` of rows with slot table ``slots`` [R, width] and ``lengths`` [R] (each
        row's new position)."""
        mode = self.options.shared_prefix_attention
        if mode == "off" or len(lengths) < 2 or self.config.sliding_window is not None:
            return None
        found = find_sharing(slots, lengths)
        if found is None or (mode == "auto" and found.saved_reads() < AUTO_SHARED_READS):
            return None
        return found

    def _plan(self, rows: int) -> Plan | None:
        """The one-call plan of this model's layers for the quantised kernels running now, or None
        (a weight they do not multiply, no kernels, or more rows than they take)."""
        qk = quant.kernels().kernels
        if qk is None or rows > quant.CROSSOVER_ROWS:
            return None
        if qk.path not in self._plans:
            self._plans[qk.path] = stack_plan(self.layers, qk, self.dtype)
        return self._plans[qk.path]

    def _tree_mask(self, lengths: torch.Tensor, tree: torch.Tensor, keys_len: int) -> torch.Tensor:
        """[B, 1, T, S] bool for a token-tree block: every cached key, and the block's keys the
        tree allows (a sliding window is not applied: refused for trees by the caller)."""
        b, t = tree.shape[:2]
        k = torch.arange(keys_len, device=tree.device)[None, :] - lengths[:, None]  # [B, S]: index within the block
        inside = (k >= 0) & (k < t)
        block = tree.gather(2, k.clamp(0, t - 1)[:, None, :].expand(b, t, keys_len))  # [B, T, S]
        return ((k < 0)[:, None, :] | (inside[:, None, :] & block))[:, None]

    def _mask(self, positions: torch.Tensor, keys_len: int, uniform: bool) -> tuple[torch.Tensor | None, bool]:
        """Boolean mask [B, 1, T, S] (True = attend), or (None, is_causal) when SDPA's built-in
        cases are exact: one new token per row at a common length, or a fresh causal prefill."""
        t = positions.shape[1]
        window = self.config.sliding_window
        if uniform and window is None:
            start = int(positions[0, 0])
            if t == 1:
                return None, False
            if start == 0:
                return None, True
        k_pos = torch.arange(keys_len, device=positions.device)
        allowed = k_pos[None, None, :] <= positions[:, :, None]
        if window is not None:
            allowed &= k_pos[None, None, :] > positions[:, :, None] - window
        return allowed[:, None], False
