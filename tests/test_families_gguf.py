"""The real Gemma 3 270M GGUF (Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K tensors), when it is on disk:
greedy tokens of the native engine (dense float32, and native quantised weights through the fused
kernels) against transformers' own GGUF loader on the dequantised weights in float32, identical
or parting only at a near tie (the reference's top two log-probabilities within 1e-3)."""

import math
import os

import pytest
import torch

GEMMA = "/work/models/gemma-3-270m-q4_k_m.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
           "The three primary colors are", "To make a cup of tea, first", "In 1969, the first person to walk on",
           "The chemical symbol for gold is", "import numpy as np\n", "My favourite season is autumn because",
           "2 + 2 ="]
STEPS = 12
NEAR_TIE = 1e-3

# only the real-file test needs the file: the GGUFs below are built here
needs_gemma = pytest.mark.skipif(not os.path.exists(GEMMA), reason=f"{GEMMA} is not on this machine")


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(GEMMA), gguf_file=os.path.basename(GEMMA),
                                                dtype=torch.float32).eval()


def _greedy(forward, ids, steps):
    """Greedy tokens and, per step, the gap between the top two log-probabilities."""
    out, gaps = [], []
    ids = list(ids)
    for _ in range(steps):
        logp = forward(ids).log_softmax(-1)
        top = logp.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        out.append(int(top.indices[0]))
        ids.append(out[-1])
    return out, gaps


def _native_forward(model):
    def forward(ids):
        return model.forward(torch.tensor([ids]), model.new_cache(1, len(ids)), last_only=True)[0, -1]
    return forward


@needs_gemma
@pytest.mark.parametrize("weights", ["dense", "native"])
def test_gemma3_greedy_tokens_match_transformers(reference, weights):
    from metaloom.models import load

    loaded = load(GEMMA, backend="native", weights=weights)
    assert loaded.backend == "native" and loaded.model.config.model_type == "gemma3_text"
    if weights == "native":
        assert loaded.model.fused is not None and loaded.model._plan(1) is not None  # every layer in one C call
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = loaded.tokenizer.encode(prompt)
            ref, gaps = _greedy(lambda x: reference(torch.tensor([x])).logits[0, -1], ids, STEPS)
            # cached decode: the prefill and then one fused step a token
            cache = loaded.model.new_cache(1, len(ids) + STEPS)
            logits = loaded.model.forward(torch.tensor([ids]), cache, last_only=True)[0, -1]
            mine = []
            for _ in range(STEPS):
                mine.append(int(logits.argmax()))
                logits = loaded.model.forward(torch.tensor([[mine[-1]]]), cache)[0, -1]
            first = next((i for i, (a, b) in enumerate(zip(mine, ref, strict=True)) if a != b), None)
            assert first is None or gaps[first] < NEAR_TIE, (prompt, mine, ref, gaps)


# --- GGUFs built here, of each native family: metaloom's reader against the model's own weights,
# and against transformers' GGUF loader (no file on disk needed) ---------------------------------

_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
            "post_attention_layernorm": "ffn_norm"}
_GEMMA_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_FAMILIES = {
    "gemma3": ("gemma3_text", {"sliding_window": 8, "tie_word_embeddings": True,  # the default query scaling
                               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0, "eos_token_id": 1}),
}


def _write_gguf(hf, arch, path, tensors=()):
    """hf's weights as llama.cpp's converter writes them (``tensors``: extra (name, array) pairs)."""
    import gguf
    import numpy as np

    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads),
                       ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters.get("rope_theta", 1e6)
                                                  if "rope_theta" in c.rope_parameters else 1e6))
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", c.sliding_window)
    if arch == "llama":
        w.add_uint32("llama.rope.dimension_count", c.head_dim)
    for name, x in tensors:
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    names = _TO_GGUF | (_GEMMA_TO_GGUF if arch == "gemma3" else {})
    for name, p in hf.state_dict().items():
        x = p.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1  # llama.cpp stores Gemma's norms as they multiply
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):  # interleaved rotary rows
                x = _permute(x, c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{names[module]}.{kind}", np.ascontiguousarray(x))
        elif name != "lm_head.weight" or not c.tie_word_embeddings:
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_FAMILIES))
def test_a_gguf_of_each_family_reads_to_its_model(tmp_path, arch):
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.models.engine.gguf_file import read_gguf
    from metaloom.models.engine.llama import LlamaModel
    from tests.test_families_native import BASE, _build

    model_type, extra = GGUF_FAMILIES[arch]
    hf, _, _ = _build(model_type, BASE | {"num_hidden_layers": 6} | extra, tmp_path / "hf")
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(hf, arch, path)
    cfg, sd = read_gguf(str(path))
    config = LlamaConfig.from_hf(cfg)
    assert cfg["model_type"] == model_type and config.layer_types == LlamaConfig.from_hf(hf.config.to_dict()).layer_types
    ours = LlamaModel.from_state_dict(config, sd)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours.forward(ids, ours.new_cache(1, 32)) - ref).abs().max().item() <= 1e-4


# --- a Llama 3.x GGUF: llama.cpp stores the llama3 RoPE scaling as a `rope_freqs` tensor of
# per-frequency divisors, and permutes Q and K rows for the interleaved rotary layout -------------

LLAMA3 = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama_cpp_rope_freqs(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """The divisors as llama.cpp's convert_hf_to_gguf writes them (its loop, written out here)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original_max_position_embeddings / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_max_position_embeddings / low_freq_factor:
            out.append(factor)
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _permute(w, heads):
    """llama.cpp's permute of Q/K rows: [(heads, 2, D/2), ...] -> [(heads, D/2, 2), ...]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_gguf(tmp_path, freqs):
    from tests.test_families_native import BASE, _build

    hf, _, _ = _build("llama", BASE | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0} | LLAMA3},
                      tmp_path / "hf")
    path = tmp_path / "llama3.gguf"
    _write_gguf(hf, "llama", path, [("rope_freqs.weight", freqs)])
    return hf, path


def test_a_llama3_gguf_with_rope_freqs_runs_as_its_model_past_the_original_context(tmp_path):
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.models.engine.gguf_file import read_gguf
    from metaloom.models.engine.llama import LlamaModel

    head_dim = 32
    freqs = _llama_cpp_rope_freqs(head_dim, 10000.0, **LLAMA3)
    assert 1.0 < sorted(freqs)[len(freqs) // 2] < LLAMA3["factor"] or any(1 < f < 4 for f in freqs)  # blended ones
    hf, path = _llama3_gguf(tmp_path, freqs)
    cfg, sd = read_gguf(str(path))
    scaling = cfg.get("rope_scaling") or cfg["rope_parameters"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == LLAMA3["factor"]
    ours = LlamaModel.from_state_dict(LlamaConfig.from_hf(cfg), sd)
    ids = torch.randint(0, 97, (1, 110), generator=torch.Generator().manual_seed(3))  # past 64, the original context
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours.forward(ids, ours.new_cache(1, 128)) - ref).abs().max().item() <= 1e-4


def test_rope_freqs_that_are_not_llama3s_scheme_are_refused_by_name(tmp_path):
    from metaloom.errors import UnsupportedModel
    from metaloom.models.engine.gguf_file import read_gguf

    freqs = _llama_cpp_rope_freqs(32, 10000.0, **LLAMA3)
    freqs[len(freqs) // 2] *= 1.5  # no llama3 parameters give this
    _, path = _llama3_gguf(tmp_path, freqs)
    with pytest.raises(UnsupportedModel, match=r"llama3\.gguf: rope_freqs factors that are not Llama 3's"):
        read_gguf(str(path))
