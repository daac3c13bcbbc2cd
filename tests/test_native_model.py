"""The native Llama-family model against transformers, and the cache's contract."""

import json
import os

import pytest
import torch

from metaloom.errors import CacheFull, ContextWindowExceeded, InvalidParameter
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.load import load_state_dict

TOL = 1e-3


def _prompt_ids(tokenizer, n=64):
    text = "In the beginning the universe was created. This has made a lot of people very angry. " * 8
    ids = tokenizer.encode(text)[:n]
    assert len(ids) == n
    return ids


def test_smollm_prefill_and_decode_match_transformers(smollm, hf_smollm):
    ids = torch.tensor([_prompt_ids(smollm.tokenizer)])
    cache = smollm.model.new_cache(1, 128)
    ours = smollm.model.forward(ids, cache)
    with torch.no_grad():
        ref = hf_smollm(ids, use_cache=True)
    assert (ours - ref.logits).abs().max().item() <= TOL
    past, token = ref.past_key_values, ref.logits[:, -1].argmax(-1, keepdim=True)
    worst = 0.0
    for _ in range(32):
        with torch.no_grad():
            step = hf_smollm(token, past_key_values=past, use_cache=True)
        mine = smollm.model.forward(token, cache)
        worst = max(worst, (mine - step.logits).abs().max().item())
        past, token = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
    assert worst <= TOL
    assert int(cache.lengths[0]) == 64 + 32


def test_gguf_conversion_matches_transformers_own_gguf_loader(smollm):
    """Independent of our converter: transformers dequantises and un-permutes the GGUF itself."""
    from transformers import AutoModelForCausalLM

    from metaloom.models.find import default_model_path

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    ids = torch.tensor([_prompt_ids(smollm.tokenizer, 32)])
    with torch.no_grad():
        ref = hf(ids).logits
    ours = smollm.model.forward(ids, smollm.model.new_cache(1, 32))
    assert (ours - ref).abs().max().item() <= TOL


def _tiny(model_type, tmp_path, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                               tie_word_embeddings=False, **extra)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.5)
    hf.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        config = LlamaConfig.from_hf(json.load(f))
    return hf, LlamaModel.from_state_dict(config, load_state_dict(str(tmp_path)))


TINY = [
    ("qwen2", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}, "rope_theta": 500000.0}),
    ("mistral", {"sliding_window": 12}),
]


@pytest.mark.parametrize(("model_type", "extra"), TINY, ids=[t[0] for t in TINY])
def test_tiny_random_models_match_transformers(model_type, extra, tmp_path):
    hf, ours = _tiny(model_type, tmp_path, **extra)
    if model_type == "qwen2":
        assert ours.config.attention_bias and ours.layers[0].qkv_bias is not None
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    cache = ours.new_cache(2, 64)
    full = ours.forward(ids, cache)
    assert (full - ref).abs().max().item() <= 1e-4
    # cached equals uncached: prefill 25 then one token at a time
    cache = ours.new_cache(2, 64)
    parts = [ours.forward(ids[:, :25], cache)] + [ours.forward(ids[:, i:i + 1], cache) for i in range(25, 40)]
    assert (torch.cat(parts, dim=1) - ref).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return _tiny("qwen2", tmp_path_factory.mktemp("qwen"))[1]


def test_mixed_length_rows_equal_each_row_alone(tiny_qwen):
    model = tiny_qwen
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 97, (1, 9), generator=g), torch.randint(0, 97, (1, 21), generator=g)
    batch = torch.zeros(2, 21, dtype=torch.long)
    batch[0, :9], batch[1] = a[0], b[0]
    cache = model.new_cache(2, 48)
    last = model.forward(batch, cache, valid=torch.tensor([9, 21]), last_only=True)[:, -1]
    assert cache.lengths.tolist() == [9, 21]
    alone = []
    for x in (a, b):
        c = model.new_cache(1, 48)
        alone.append((c, model.forward(x, c, last_only=True)[:, -1]))
    assert torch.allclose(last[0], alone[0][1], atol=1e-5) and torch.allclose(last[1], alone[1][1], atol=1e-5)
    # then decode steps with different lengths per row
    for _ in range(5):
        nxt = last.argmax(-1, keepdim=True)
        last = model.forward(nxt, cache)[:, -1]
        for row, (c, _) in enumerate(alone):
            alone[row] = (c, model.forward(nxt[row:row + 1], c)[:, -1])
            assert torch.allclose(last[row], alone[row][1], atol=1e-5)


def test_fork_copies_rows_independently(tiny_qwen):
    model = tiny_qwen
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(2, 32)
    model.forward(ids, cache)
    forked = cache.fork([1, 1, 0])
    assert forked.lengths.tolist() == [10, 10, 10]
    step = torch.tensor([[5], [6], [7]])
    out = model.forward(step, forked)
    ref_cache = model.new_cache(1, 32)
    model.forward(ids[1:2], ref_cache)
    ref = model.forward(step[:1], ref_cache)
    assert torch.allclose(out[0], ref[0], atol=1e-5)
    assert cache.lengths.tolist() == [10, 10]  # the original is untouched
    with pytest.raises(InvalidParameter):
        cache.fork([2])


def test_truncate_rolls_back(tiny_qwen):
    model = tiny_qwen
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(1, 32)
    model.forward(ids[:, :8], cache)
    expected = model.forward(ids[:, 8:], cache)
    model.forward(torch.tensor([[1, 2, 3]]), cache)
    cache.truncate([8])
    again = model.forward(ids[:, 8:], cache)
    assert torch.allclose(again, expected, atol=1e-5)
    with pytest.raises(InvalidParameter):
        cache.truncate([99])


def test_cache_capacity_and_context_limits(tiny_qwen):
    cache = tiny_qwen.new_cache(1, 4)
    with pytest.raises(CacheFull):
        tiny_qwen.forward(torch.zeros(1, 5, dtype=torch.long), cache)
    with pytest.raises(ContextWindowExceeded):
        tiny_qwen.new_cache(1, 10_000)


def test_bfloat16_close_to_float32(smollm):
    from metaloom.models import load

    bf = load("default", dtype="bfloat16")
    ids = torch.tensor([_prompt_ids(smollm.tokenizer, 32)])
    a = smollm.model.forward(ids, smollm.model.new_cache(1, 32))
    b = bf.model.forward(ids, bf.model.new_cache(1, 32)).float()
    # bf16 has 8 bits of mantissa: compare distributions, not logits
    pa, pb = torch.softmax(a[0, -1], -1), torch.softmax(b[0, -1], -1)
    assert 0.5 * (pa - pb).abs().sum().item() < 0.1
