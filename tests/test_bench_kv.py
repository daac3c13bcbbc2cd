"""`metaloom bench kv` on the tiny model: perplexity through the cache in chunks equals one
forward's for a float pool, an int8 pool's stays near it, bytes per token follow the storage
dtype, and bad input is refused by name."""

import dataclasses
import math

import pytest
import torch

from metaloom.bench.kv import held_out_ids, held_out_text, measure, perplexity
from metaloom.errors import InvalidParameter
from metaloom.models.engine.options import EngineOptions
from metaloom.testing.tiny import tiny_llama


def test_chunked_perplexity_equals_one_forward_for_a_float_pool():
    loaded = tiny_llama()
    model = loaded.model
    ids = torch.randint(0, 26, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(1, len(ids))
    logits = model.forward(torch.tensor([ids]), cache)[0]
    cache.release()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert perplexity(model, ids, chunk=32) == pytest.approx(math.exp(float(nll)), rel=1e-5)
    int8 = model.with_options(EngineOptions(kv_dtype="int8"))
    assert perplexity(int8, ids, chunk=32) == pytest.approx(math.exp(float(nll)), rel=0.05)
    assert perplexity(int8, ids, chunk=32) != perplexity(model, ids, chunk=32)  # the stored keys were read


class _Folded:
    """The tiny model's letters tokenizer, taking any text (code points folded into 26 ids)."""

    eos_token_ids = frozenset()

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 26 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_measure_reports_every_side():
    loaded = dataclasses.replace(tiny_llama(), tokenizer=_Folded())
    result = measure(loaded, ["auto", "bfloat16", "int8"], text_tokens=120, haystack=100, chunk=32,
                     depths=(0.5,), codes=("12",), speed_tokens=3, repeats=1)
    sides = result["sides"]
    # 2 layers x 2 kv heads x head_dim 8, keys and values: 4 bytes each, 2, or 1 plus a float32 scale per head
    assert [sides[k]["bytes_per_token"] for k in ("auto", "bfloat16", "int8")] == [256, 128, 64 + 2 * 2 * 2 * 4]
    for side in sides.values():
        assert math.isfinite(side["perplexity"]) and side["decode_tok_s"] > 0
        assert len(side["retrieval"]["trials"]) == 1


def test_bad_input_is_refused_by_name():
    loaded = dataclasses.replace(tiny_llama(), tokenizer=_Folded())
    with pytest.raises(InvalidParameter, match="kv_dtypes"):
        measure(loaded, ["int4"])
    with pytest.raises(InvalidParameter, match="text_tokens"):
        measure(loaded, ["auto"], text_tokens=10**6)
    with pytest.raises(InvalidParameter, match="chunk"):
        measure(loaded, ["auto"], chunk=0)
    assert len(held_out_text()) > 20000


class _WithBos:
    """A tokenizer that puts a BOS token (id 1) before the text when asked for special tokens."""

    def encode(self, text, add_special_tokens=True):
        ids = [3 + ord(ch) % 50 for ch in text[:100]]
        return [1, *ids] if add_special_tokens else ids


def test_the_held_out_text_is_scored_after_the_tokenizers_bos():
    """Gemma and Llama 3 read text after BOS: without it Gemma 3 270M's perplexity on these docs
    is 405 instead of 54, so the benches score the ids the tokenizer makes with its specials."""
    ids = held_out_ids(_WithBos())
    assert ids[0] == 1 and ids[1:] == _WithBos().encode(held_out_text(), add_special_tokens=False)
