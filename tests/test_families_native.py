"""Each family the native engine runs (Qwen3, Gemma 2, Gemma 3, Phi-3 / Phi-4-mini, Llama 3.x)
against transformers' own implementation of a model built to its shape with random weights:
logits within 1e-4 in float32 over prompts of several lengths (sliding windows passed), cached
(step by step, PyTorch ops and the fused one-token kernels) against uncached."""

import json

import pytest
import torch

from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.kernels import fused
from metaloom.models.load import load_state_dict

TOL = 1e-4
VOCAB = 97
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
        "tie_word_embeddings": False}

ORIGINAL = 32  # the LongRoPE model's original context: its long factors apply from there on
# Phi-3's head_dim is hidden / heads: 32
PHI = {"num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0, "eos_token_id": 1}
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 0.5,
                          "final_logit_softcapping": 3.0, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", {"sliding_window": 8, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                               "sliding_attention"],
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1e4}}}),
    "phi3-longrope": ("phi3", PHI | {
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                         "long_factor": [1.0 + 0.5 * i for i in range(16)]}}),
    "phi4-partial-rotary": ("phi3", PHI | {"partial_rotary_factor": 0.5, "tie_word_embeddings": True}),
    "phi3-window": ("phi3", PHI | {"sliding_window": 12}),
    "llama3-tied": ("llama", {"tie_word_embeddings": True, "rope_theta": 500000.0,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
}
LENGTHS = (5, 17, 40)  # past the 8- and 12-token windows, and past Phi-3's 32-token original context


def _build(model_type, extra, folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **(BASE | extra))
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # random init leaves norms at one (Gemma: zero); make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if "gemma" in model_type else 1.0, 0.3)
    hf.save_pretrained(folder)
    with open(folder / "config.json") as f:
        config = LlamaConfig.from_hf(json.load(f))
    return hf, config, LlamaModel.from_state_dict(config, load_state_dict(str(folder)))


@pytest.fixture(scope="module", params=list(FAMILIES), ids=list(FAMILIES))
def family(request, tmp_path_factory):
    model_type, extra = FAMILIES[request.param]
    return (request.param, *_build(model_type, extra, tmp_path_factory.mktemp(request.param)))


def _ids(t, seed=1):
    return torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed))


def _reference(hf, ids, name=""):
    """transformers' logits of ``ids``. LongRoPE past its original context: its cached decode
    from there on (the first ORIGINAL positions prefilled with the short factors, each later one
    rotated with the long ones), which is what the engine's per-position tables give; an
    uncached transformers forward that long rotates every position with the long factors."""
    with torch.no_grad():
        if name != "phi3-longrope" or ids.shape[1] <= ORIGINAL:
            return hf(ids).logits
        out = hf(ids[:, :ORIGINAL], use_cache=True)
        logits, past = [out.logits], out.past_key_values
        for i in range(ORIGINAL, ids.shape[1]):
            out = hf(ids[:, i:i + 1], past_key_values=past, use_cache=True)
            logits.append(out.logits)
            past = out.past_key_values
        return torch.cat(logits, dim=1)


def test_the_config_names_the_family(family):
    name, _, config, _ = family
    if name == "qwen3":
        assert config.qk_norm and not config.post_norms
    if name.startswith("gemma"):
        assert config.post_norms and config.norm_offset == 1.0 and config.activation == "gelu_tanh"
        assert config.embed_scale == pytest.approx(8.0) and config.layer_window(0) == 8
        assert config.layer_window(1 if name == "gemma2" else 2) is None  # a global layer
    if name == "gemma2":
        assert config.attn_softcap == 0.5 and config.final_softcap == 3.0 and config.attention_scale == 24 ** -0.5
    if name == "gemma3":
        assert config.qk_norm and config.layer_rope(0)[0] == 1e4 and config.layer_rope(2) == (
            1e6, {"factor": 2.0, "rope_type": "linear"})
    if name == "phi4-partial-rotary":
        assert config.rotary_dim == 16


@pytest.mark.parametrize("t", LENGTHS)
def test_logits_match_transformers(family, t):
    name, hf, _, ours = family
    ids = _ids(t)
    ref = _reference(hf, ids, name)
    assert (ours.forward(ids, ours.new_cache(2, 64)) - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("fused_kernels", [False, True], ids=["pytorch-ops", "fused"])
def test_cached_steps_match_uncached(family, fused_kernels):
    name, hf, config, ours = family
    if fused_kernels:
        available = fused.kernels()
        if available.kernels is None:
            pytest.skip(f"no fused kernels here: {available.reason}")
        assert fused.unsupported_reason(config, torch.float32, torch.device("cpu")) is None
        ours = ours.with_fused(available.kernels)
    ids = _ids(40, seed=3)
    ref = _reference(hf, ids, name)
    cache = ours.new_cache(2, 64)
    parts = [ours.forward(ids[:, :3], cache)] + [ours.forward(ids[:, i:i + 1], cache) for i in range(3, 40)]
    assert (torch.cat(parts, dim=1) - ref).abs().max().item() <= TOL


def test_long_rope_switches_to_the_long_factors_at_the_original_context(family):
    name, hf, _, ours = family
    if name != "phi3-longrope":
        pytest.skip("LongRoPE only")
    ids = _ids(40, seed=4)
    uncached = _reference(hf, ids[:, :ORIGINAL + 1])  # 33 positions: transformers rotates all with the long factors
    mine = ours.forward(ids[:, :ORIGINAL + 1], ours.new_cache(2, 64))
    assert (mine[:, -1] - uncached[:, -1]).abs().max().item() > 1e-3  # the factors differ: the test can see them
    assert (mine - _reference(hf, ids[:, :ORIGINAL + 1], name)).abs().max().item() <= TOL


def test_rows_of_different_lengths_past_the_window_equal_each_row_alone(family):
    _, _, _, ours = family
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, VOCAB, (1, 9), generator=g), torch.randint(0, VOCAB, (1, 21), generator=g)
    batch = torch.zeros(2, 21, dtype=torch.long)
    batch[0, :9], batch[1] = a[0], b[0]
    cache = ours.new_cache(2, 48)
    last = ours.forward(batch, cache, valid=torch.tensor([9, 21]), last_only=True)[:, -1]
    for row, x in enumerate((a, b)):
        alone = ours.forward(x, ours.new_cache(1, 48), last_only=True)[:, -1]
        assert torch.allclose(last[row], alone[0], atol=TOL)
