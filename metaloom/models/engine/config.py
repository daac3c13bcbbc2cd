"""`LlamaConfig`: the decoder-only architectures the native engine runs, as one frozen dataclass
read from a transformers ``config.json`` dict.

The families share one layer (RMSNorm, RoPE, grouped-query attention, a gated MLP) and differ
in a few switches, each a field here with the Llama layer as its default:

- Llama 3.x, SmolLM2, Mistral (a sliding window in every layer), Qwen2 (q/k/v biases);
- Qwen3: RMSNorm over each head's query and key before RoPE (``qk_norm``);
- Gemma 2 and Gemma 3 (``gemma2``, ``gemma3_text``): embeddings scaled by sqrt(d), norms that
  scale by (1 + w) (``norm_offset``), norms after the attention and MLP outputs too
  (``post_norms``), GeGLU with tanh-approximated GELU, sliding-window and global layers
  alternating (``layer_types``) with their own RoPE bases (Gemma 3's ``local_rope``), the query
  scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped attention and final logits (Gemma 2);
  Gemma 3 has per-head q/k norms too;
- Phi-3, 3.5 and 4-mini: q/k/v and gate/up fused in the checkpoint (the engine fuses them
  anyway), LongRoPE scaling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metaloom.errors import UnsupportedModel

NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3"})
ROPE_TYPES = ("default", "linear", "llama3", "longrope")  # "su": Phi-3's old name for longrope
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
FULL, SLIDING = "full_attention", "sliding_attention"
_GEMMA = ("gemma2", "gemma3_text")

Scaling = tuple[tuple[str, Any], ...]  # a frozen RoPE scaling mapping (lists as tuples)


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2 always, Llama optionally)
    rope_scaling: Scaling | None = None
    sliding_window: int | None = None  # set when any layer slides (``layer_types`` says which)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # --- where the families differ (the defaults are the Llama layer) ---
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # norms scale by (offset + w): Gemma's 1
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before each residual add (Gemma)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    activation: str = "silu"  # the gate's: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (None: head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    layer_types: tuple[str, ...] | None = None  # FULL or SLIDING per layer; None: every layer as sliding_window says
    local_rope_theta: float | None = None  # the sliding layers' own RoPE base (Gemma 3)
    local_rope_scaling: Scaling | None = None
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (Phi-4-mini: 0.75)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window in positions, or None (it attends every position)."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[i] != SLIDING):
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> tuple[float, dict[str, Any] | None]:
        """(RoPE base, scaling) of layer ``i``: a sliding layer's own where the model has one."""
        if self.local_rope_theta is not None and self.layer_window(i) is not None:
            return self.local_rope_theta, dict(self.local_rope_scaling) if self.local_rope_scaling else None
        return self.rope_theta, self.rope_scaling_dict

    @property
    def plain(self) -> bool:
        """Whether every layer is the Llama layer (what the GPU static step implements)."""
        return (not self.qk_norm and not self.norm_offset and not self.post_norms and self.embed_scale is None
                and self.activation == "silu" and self.attention_scale == self.head_dim ** -0.5
                and self.attn_softcap is None and self.final_softcap is None and self.local_rope_theta is None
                and self.partial_rotary_factor == 1.0 and (self.layer_types is None or len(set(self.layer_types)) == 1))

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """From a transformers config dict (4.x or 5.x layout). A model type, RoPE scaling,
        activation or layer type the native engine does not run is an `UnsupportedModel`
        naming it and what is supported."""
        model_type = cfg.get("model_type", "")
        if model_type not in NATIVE_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} has no native implementation (native: "
                f"{sorted(NATIVE_MODEL_TYPES)}); load it with backend='transformers'"
            )
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        gemma = model_type in _GEMMA
        (theta, scaling), local = _rope(cfg)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"activation {act!r} (native: {sorted(ACTIVATIONS)})")
        types = _layer_types(cfg, model_type, layers)
        window = cfg.get("sliding_window") if types is None or SLIDING in types else None
        if types is not None and SLIDING in types and not window:
            raise UnsupportedModel(f"layer types name {SLIDING!r} but the config has no sliding_window")
        partial = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        hidden = cfg["hidden_size"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            post_norms=gemma,
            embed_scale=math.sqrt(hidden) if gemma else None,
            activation=ACTIVATIONS[act],
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            layer_types=types,
            local_rope_theta=None if local is None else local[0],
            local_rope_scaling=None if local is None else local[1],
            partial_rotary_factor=float(partial),
        )


def _layer_types(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[str, ...] | None:
    """Each layer's attention kind, or None where every layer is alike (Llama, Mistral, Phi-3:
    the sliding window, when set, applies to all)."""
    types = cfg.get("layer_types")
    if types is None:
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            return (FULL,) * layers  # transformers 4.x: no window unless asked for
        if model_type in _GEMMA:  # transformers 4.x: Gemma 2 alternates, Gemma 3 every 6th layer global
            every = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
            return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(layers))
        return None if model_type in ("mistral", "phi3") else (FULL,) * layers
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown or len(types) != layers:
        raise UnsupportedModel(f"layer types {unknown or len(types)} (native: {layers} of {FULL!r} / {SLIDING!r})")
    return tuple(types)


def _scaling(params: Mapping[str, Any] | None) -> Scaling | None:
    """A frozen RoPE scaling, or None for the default; an unknown type is an `UnsupportedModel`."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope scaling type {kind!r} (native: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    items = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()
             if k not in ("rope_theta", "type", "partial_rotary_factor") and not isinstance(v, dict)}
    return tuple(sorted((items | {"rope_type": kind}).items()))


def _rope(cfg: Mapping[str, Any]) -> tuple[tuple[float, Scaling | None], tuple[float, Scaling | None] | None]:
    """((base, scaling) of the global layers, (base, scaling) of the sliding ones or None when
    they share the global one). transformers 5 nests RoPE under ``rope_parameters``, per layer
    type for Gemma 3; 4.x keeps ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq`` flat."""
    params = dict(cfg.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:
        full, slide = params.get(FULL) or {}, params.get(SLIDING)
        glob = (float(full.get("rope_theta", cfg.get("rope_theta", 10000.0))), _scaling(full))
        local = None if slide is None else (float(slide.get("rope_theta", 10000.0)), _scaling(slide))
        return glob, local
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = _scaling(cfg.get("rope_scaling") or params)
    if scaling is not None and dict(scaling)["rope_type"] == "longrope":
        # LongRoPE's defaults live beside the scaling in the config (Phi-3)
        items = dict(scaling)
        items.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        items.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        scaling = tuple(sorted(items.items()))
    local_theta = cfg.get("rope_local_base_freq")
    return (theta, scaling), None if local_theta is None else (float(local_theta), None)
