"""A tiny random native Llama model with a character tokenizer: the real `LlamaModel` (its KV
pool, fused kernels, prefill/verify paths) at toy size, so engine tests run in milliseconds."""

from __future__ import annotations

import torch

from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.load import LoadedModel
from metaloom.testing.toy_models import CharTokenizer


def tiny_llama(vocab: int = 26, seed: int = 0) -> LoadedModel:
    """Two layers, hidden size 32, 4 query and 2 key/value heads of 8; tokens are the letters
    a, b, c, ... (`CharTokenizer`)."""
    config = LlamaConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, 32, generator=g),
          "lm_head.weight": torch.randn(vocab, 32, generator=g), "model.norm.weight": torch.ones(32)}
    shapes = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (16, 32), "self_attn.v_proj": (16, 32),
              "self_attn.o_proj": (32, 32), "mlp.gate_proj": (64, 32), "mlp.up_proj": (64, 32), "mlp.down_proj": (32, 64)}
    for i in range(2):
        for name, shape in shapes.items():
            sd[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(32)
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(32)
    model = LlamaModel.from_state_dict(config, sd)
    return LoadedModel(model=model, tokenizer=CharTokenizer(vocab), name="tiny", folder="", dtype=torch.float32)


def random_weights(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """transformers-named random weights for ``config``: linear weights N(0, 1/in), norms near 1,
    q/k/v biases where the config has them, an ``lm_head`` where its embeddings are not tied."""
    g = torch.Generator().manual_seed(seed)
    c = config
    d, hd = c.hidden_size, c.head_dim
    sd = {"model.embed_tokens.weight": torch.randn(c.vocab_size, d, generator=g),
          "model.norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = torch.randn(c.vocab_size, d, generator=g) / d ** 0.5
    shapes = {"self_attn.q_proj": (c.num_attention_heads * hd, d), "self_attn.k_proj": (c.num_key_value_heads * hd, d),
              "self_attn.v_proj": (c.num_key_value_heads * hd, d), "self_attn.o_proj": (d, c.num_attention_heads * hd),
              "mlp.gate_proj": (c.intermediate_size, d), "mlp.up_proj": (c.intermediate_size, d),
              "mlp.down_proj": (d, c.intermediate_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        if c.attention_bias:
            for n in "qkv":
                sd[p + f"self_attn.{n}_proj.bias"] = torch.randn(shapes[f"self_attn.{n}_proj"][0], generator=g)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[p + norm + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    return sd
