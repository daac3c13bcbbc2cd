"""The native model of every family the engine runs (Llama, SmolLM2, Qwen2 and Qwen3, Mistral,
Gemma 2 and 3, Phi-3: `metaloom.models.engine.config` says how they differ).

Plain tensors and `torch.nn.functional`, no `nn.Module` tree: at batch 1 on a CPU the per-op
overhead is a large share of a decode step, so q/k/v and gate/up are fused into one matmul
each and one attention mask per window is shared by all layers. One-token steps on the CPU
(float32, bfloat16) go further when the model was given `metaloom.models.kernels.fused` kernels:
everything between the matmuls runs in a few C calls per layer
(`metaloom.models.engine.fused_step`), and so does a speculative verify of a few tokens per
row; prefill takes the PyTorch ops (`metaloom.models.engine.eager`). Keys and values live in a
KV pool of token slots (`metaloom.models.engine.pool`) shared by the caches made from it
(`metaloom.models.engine.cache`): a forked row reads its parent's keys where they are.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import replace

import torch

from metaloom.errors import ContextWindowExceeded, InvalidParameter, NotAModel, UnsupportedModel
from metaloom.models.engine import dropping, eager, fused_step, graphs
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.fused_step import AUTO_SHARED_READS, FUSED_VERIFY_WIDTH
from metaloom.models.engine.graphs import StepGraphs
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.pool import KVPool, storage_dtype
from metaloom.models.engine.rope import rope_tables
from metaloom.models.engine.sharing import Sharing
from metaloom.models.engine.stack import Plan
from metaloom.models.engine.stack import plan as stack_plan
from metaloom.models.engine.weights import (
    Concat,
    Embedding,
    LayerWeights,
    MatMul,
    RowTable,
    Weight,
    build_layers,
    dense_weight,
    embed_tokens,
    linear,
    panelled,
    plain_weight,
    require,
    stack,
)
from metaloom.models.flops import forward_flops
from metaloom.models.kernels import quant
from metaloom.models.kernels.fused import FusedKernels, unsupported_reason
from metaloom.models.kernels.packed import own_bf16, pack
from metaloom.models.protocols import KVCache

__all__ = ["AUTO_SHARED_READS", "FUSED_VERIFY_WIDTH", "Concat", "Embedding", "LayerWeights", "LlamaModel", "MatMul",
           "RowTable", "Weight", "dense_weight", "embed_tokens", "linear", "plain_weight", "stack"]


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
        if self.options.drops and (config.sliding_window is not None or config.attn_softcap is not None
                                   or config.attention_scale != config.head_dim ** -0.5):
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
        # each layer's RoPE tables (Gemma 3's sliding layers have a base of their own) and window
        tables: dict[tuple[float, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.ropes: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(len(self.layers)):
            theta, scaling = config.layer_rope(i)
            key = (theta, repr(scaling))
            if key not in tables:
                tables[key] = rope_tables(config.head_dim, theta, scaling, config.max_position_embeddings, self.dtype,
                                          norm.device, config.rotary_dim)
            self.ropes.append(tables[key])
        self.windows = [config.layer_window(i) for i in range(len(self.layers))]
        full = next((i for i, w in enumerate(self.windows) if w is None), 0)
        self._cos, self._sin = self.ropes[full] if self.ropes else rope_tables(
            config.head_dim, config.rope_theta, config.rope_scaling_dict, config.max_position_embeddings, self.dtype,
            norm.device, config.rotary_dim)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: LlamaConfig, sd: Mapping[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        blocks: Mapping[str, MatMul] | None = None) -> LlamaModel:
        """Build from transformers-named weights (``model.layers.0.self_attn.q_proj.weight`` …,
        Phi-3's fused ``qkv_proj`` and ``gate_up_proj``). ``blocks``: weights kept quantised
        (`metaloom.models.engine.native`), by the same names; they stand in for ``sd``'s tensors
        of those names (an embedding among them must also look up rows, a `RowTable`)."""
        kept = blocks or {}
        get = require(sd, dtype, device)

        def weight(name: str) -> Weight:
            return kept[name] if name in kept else get(name)

        layers = build_layers(config, get, weight, lambda name: name in sd or name in kept)
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
        norm = get("model.norm.weight")
        return cls(config, embed, layers, norm + config.norm_offset if config.norm_offset else norm, head)


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
            n += sum(t.numel() for t in (w.qkv_bias, w.q_norm, w.k_norm, w.post_attn_norm, w.post_mlp_norm)
                     if t is not None)
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
        return self.logits(self._hidden(tokens, cache, valid, last_only, tree))

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
        return self.logits(x), x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] after the final norm -> logits [..., V] (soft-capped where the model
        caps them: Gemma 2)."""
        out = linear(hidden, self.lm_head)
        cap = self.config.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> the residual stream's first vectors [..., d] (a fresh tensor), scaled
        where the model scales them (Gemma: by sqrt(d), rounded to the activations' dtype as
        transformers rounds it)."""
        x = embed_tokens(self.embed, tokens, self.dtype)
        scale = self.config.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=self.dtype)

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
        """(logits, hidden) of a decode step or short verify through `step_graphs`, or None
        (the eager path): `metaloom.models.engine.graphs.static_forward`."""
        return graphs.static_forward(self, tokens, cache, valid, last_only, tree)

    def _hidden(self, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None,
                last_only: bool, tree: torch.Tensor | None = None) -> torch.Tensor:
        """The transformer up to and including the final norm: [B, T, d] (or [B, 1, d]), through
        the fused one-token step, the fused verify, or PyTorch ops (`metaloom.models.engine.eager`)."""
        if not isinstance(cache, PagedKVCache) or cache.pool.layers != len(self.layers):
            raise InvalidParameter("cache", type(cache).__name__, "a PagedKVCache from this model's new_cache()")
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
            y = fused_step.step_fused(self, tokens, cache, lengths, valid, self.fused)
            if opts.drops:
                dropping.after_forward(opts, cache, 1, None)
            return y
        if self._verify_applies(cache, t, tree):
            assert self.fused is not None  # checked by _verify_applies
            return fused_step.verify_fused(self, tokens, cache, valid, tree, last_only, self.fused)
        return eager.forward(self, tokens, cache, lengths, slots, valid, tree, last_only)

    # --- the fused one-token path (metaloom.models.engine.fused_step) ---------------------
    def fused_reads(self, pool: KVPool) -> bool:
        return fused_step.fused_reads(self, pool)

    def _verify_applies(self, cache: PagedKVCache, t: int, tree: torch.Tensor | None) -> bool:
        return fused_step.verify_applies(self, cache, t, tree)

    def _sharing(self, cache: PagedKVCache) -> Sharing | None:
        """The positions this step's rows share in the pool (`fused_step.sharing_of`), or None."""
        return fused_step.sharing_of(self, cache.slots, cache.host_lengths())

    def _plan(self, rows: int) -> Plan | None:
        """The one-call plan of this model's layers for the quantised kernels running now, or None
        (a weight they do not multiply, no kernels, or more rows than they take)."""
        qk = quant.kernels().kernels
        if qk is None or rows > quant.CROSSOVER_ROWS:
            return None
        if qk.path not in self._plans:
            self._plans[qk.path] = stack_plan(self.layers, qk, self.dtype, self.ropes, self.windows)
        return self._plans[qk.path]
