"""`LlamaConfig`: the Llama-family architecture (Llama, SmolLM2, Qwen2, Mistral) as a frozen
dataclass, read from a transformers ``config.json`` dict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metaloom.errors import UnsupportedModel

NATIVE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})


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
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen mapping
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in NATIVE_MODEL_TYPES:
            raise UnsupportedModel(
                f"model_type {model_type!r} has no native implementation (native: "
                f"{sorted(NATIVE_MODEL_TYPES)}); load it with backend='transformers'"
            )
        heads = cfg["num_attention_heads"]
        # transformers 5 nests rope settings under rope_parameters; 4.x keeps them flat.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise UnsupportedModel(f"rope scaling type {kind!r} (native: default, linear, llama3)")
            scaling = tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict))))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """A transformers ``config.json`` for these weights (so transformers can load the
        converted folder too: the benchmark and the equivalence tests rely on that)."""
        d = dataclasses.asdict(self)
        d["rope_scaling"] = self.rope_scaling_dict
        d["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0]
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        d["architectures"] = [arch[self.model_type]]
        if self.sliding_window is None:
            d.pop("sliding_window")
            d["use_sliding_window"] = False
        return d
