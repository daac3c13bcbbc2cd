"""Read a llama.cpp GGUF file into a transformers-style config and state dict.

Weights are dequantised with the `gguf` package (any quantisation type it knows). llama.cpp's
converter permutes the rows of Q and K for the "llama" architecture (interleaved rotary
layout); we undo that so the weights use the rotate-half layout of transformers.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import torch

from metaloom.errors import NotAModel, UnsupportedModel
from metaloom.models.engine.rope import llama3_scaling_from_factors

# GGUF architecture -> transformers model type, for the architectures the native engine runs
ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3": "gemma3_text", "phi3": "phi3"}
_GEMMA = ("gemma2", "gemma3")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused q, k, v
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# where an architecture names a layer tensor otherwise
_ARCH_LAYER_NAMES = {
    "gemma": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"},  # gate and up fused, gate first
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# read into the config, not weights: llama3 rope factors, Phi-3's LongRoPE factors
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def architecture(path: str) -> str:
    """The GGUF's ``general.architecture`` (a quick read of its header)."""
    arch = _field(_reader(path), "general.architecture")
    if not isinstance(arch, str):
        raise NotAModel(f"{path} names no general.architecture")
    return arch


def _reader(path: str) -> Any:
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise NotAModel(f"{path} is not a GGUF file (no GGUF magic)")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises assorted errors on corrupt files
        if _ran_past_the_end(exc):
            raise NotAModel(f"{path} is shorter than its GGUF header says ({os.path.getsize(path):,} bytes): "
                            f"truncated (an interrupted download or copy?) or a corrupt header; gguf: {exc}") from exc
        raise NotAModel(f"{path} could not be read as GGUF: {exc}") from exc


def _ran_past_the_end(exc: Exception) -> bool:
    """Whether the gguf package failed because a field or tensor it read ran past the file's end:
    it reads through a memory map, whose slices past the end come back short, and then fails to
    view or reshape them (numpy's "cannot reshape array of size ..." or "... must be a divisor
    of the total size ...")."""
    text = str(exc)
    return isinstance(exc, ValueError) and ("cannot reshape array" in text or "must be a divisor" in text)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _rows(reader: Any, name: str) -> int:
    """The outputs (rows) of tensor ``name`` (GGUF lists dims fastest first), or 0."""
    return next((int(t.shape[-1]) for t in reader.tensors if t.name == name), 0)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` for Q/K rows: [(heads, D/2, 2), ...] -> [(heads, 2, D/2), ...]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(reader: Any, arch: str, path: str) -> dict[str, Any]:
    """The transformers config dict of a GGUF of a native architecture: its metadata, the rest
    from the transformers config class's defaults for that model type (as transformers' own
    GGUF loader fills them: Gemma 3's layer pattern and local RoPE base, the query scaling), so
    the converted folder loads in transformers as the GGUF does."""
    def num(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    eos_fields = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = sorted({int(x) for key in eos_fields if (x := _field(reader, key)) is not None})
    head_dim = int(num("attention.key_length", hidden // heads))
    cfg: dict[str, Any] = {
        "vocab_size": int(num("vocab_size", len(tokens.data) if tokens else _rows(reader, "token_embd.weight"))),
        "hidden_size": hidden,
        "intermediate_size": int(num("feed_forward_length")),
        "num_hidden_layers": int(num("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(num("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(num("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos if len(eos) > 1 else (eos[0] if eos else None),
    }
    if arch in _GEMMA and num("attention.sliding_window") is not None:
        cfg["sliding_window"] = int(num("attention.sliding_window"))
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = num("attn_logit_softcapping")
        cfg["final_logit_softcapping"] = num("final_logit_softcapping")
    if arch == "phi3" and num("attention.sliding_window"):
        cfg["sliding_window"] = int(num("attention.sliding_window"))
    rotary = num("rope.dimension_count")
    if arch == "phi3" and rotary and int(rotary) != head_dim:
        cfg["partial_rotary_factor"] = int(rotary) / head_dim
    factor, kind = num("rope.scaling.factor"), num("rope.scaling.type")
    if kind == "linear" and factor:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif "rope_factors_long.weight" in names:  # Phi-3's LongRoPE: the factors are tensors
        tensors = {t.name: np.asarray(t.data, dtype=np.float32).tolist() for t in reader.tensors
                   if t.name.startswith("rope_factors_")}
        scaling = {"rope_type": "longrope", "long_factor": tensors["rope_factors_long.weight"],
                   "short_factor": tensors["rope_factors_short.weight"],
                   "original_max_position_embeddings": int(num("rope.scaling.original_context_length"))}
        if num("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(num("rope.scaling.attn_factor"))
        cfg["rope_scaling"] = scaling
    elif "rope_freqs.weight" in names:  # Llama 3.x: its scaling stored as per-frequency divisors
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rotated = int(rotary) if rotary else head_dim
        try:
            scaling = llama3_scaling_from_factors(np.asarray(freqs.data, dtype=np.float32).tolist(), rotated,
                                                  cfg["rope_theta"], int(num("rope.scaling.original_context_length", 8192)))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"{path}: {exc}") from exc
        if scaling["rope_type"] != "default":
            cfg["rope_scaling"] = scaling
    from transformers import AutoConfig

    try:
        full: dict[str, Any] = AutoConfig.for_model(ARCH_TO_MODEL_TYPE[arch], **cfg).to_dict()
    except Exception as exc:  # transformers validates the config (RoPE factors' lengths, ...)
        raise NotAModel(f"{path}: its metadata is not a valid {arch} config: {exc}") from exc
    full.pop("transformers_version", None)
    return full


def read_gguf(path: str, keep: frozenset[int] = frozenset()) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (transformers config dict, state dict). Tensors are dequantised to float32,
    except 2-D ones whose ggml type id is in ``keep``: those stay the file's blocks, a uint8
    tensor [out, row bytes] (each output row's blocks along the input dimension, as GGUF stores
    them); `read_gguf_blocks` also says which tensors those are and their types."""
    config, sd, _ = _read(path, keep)
    return config, sd


def read_gguf_blocks(path: str, keep: frozenset[int]) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, int]]:
    """`read_gguf` that also returns the ggml type id of every tensor kept as blocks."""
    return _read(path, keep)


def _read(path: str, keep: frozenset[int]) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, int]]:
    from gguf.quants import dequantize

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise UnsupportedModel(f"GGUF architecture {arch!r} (native: {sorted(ARCH_TO_MODEL_TYPE)})")
    config = _config(reader, arch, path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = _ARCH_LAYER_NAMES.get("gemma" if arch in _GEMMA else arch, {})
    sd: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and (m.group(2) in names or m.group(2) in _LAYER_NAMES):
            name = f"model.layers.{m.group(1)}.{names.get(m.group(2)) or _LAYER_NAMES[m.group(2)]}"
        elif t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif t.name in _SKIPPED:
            continue
        else:
            raise UnsupportedModel(f"GGUF tensor {t.name!r} has no place in the native {arch} model")
        if int(t.tensor_type) in keep and len(t.shape) == 2:
            # the reader gives the blocks as uint8 [out, row bytes]; rows are outputs, so the
            # Q/K un-permutation below moves whole rows of blocks, exactly as for floats
            w = np.array(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)  # a writable copy
            types[name] = int(t.tensor_type)
        else:
            # GGUF lists dims fastest-first; numpy's shape is the reverse (row-major).
            w = dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)]).astype(np.float32)
            if arch in _GEMMA and t.name.endswith("norm.weight"):
                w = w - 1  # llama.cpp stores Gemma's norms as they multiply (1 + w); transformers holds w
        if arch == "llama" and m and m.group(2) in ("attn_q.weight", "attn_q.bias"):
            w = _unpermute(w, heads)
        elif arch == "llama" and m and m.group(2) in ("attn_k.weight", "attn_k.bias"):
            w = _unpermute(w, kv_heads)
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    return config, sd, types


def save_gguf_tokenizer(path: str, out_dir: str) -> None:
    """Convert the GGUF's tokenizer (vocabulary, merges, chat template) to a transformers
    tokenizer folder with transformers' own GGUF converter. Slow (seconds); run once."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    tok.save_pretrained(out_dir)
