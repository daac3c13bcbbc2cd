"""`metaloom bench kv --kv-policies` on the tiny model: every side measured, a budget under the
text's length holds the row to it (peak memory while decoding, bytes at the end), ``full``'s
step-by-step perplexity equals one forward's, and bad entries are refused by name."""

import dataclasses
import math

import pytest
import torch

from metaloom.bench.kv_drop import measure, parse_policies, perplexity
from metaloom.errors import InvalidParameter
from metaloom.models.engine.kv_policy import SNAP_WINDOW
from metaloom.testing.tiny import tiny_llama
from tests.test_bench_kv import _Folded


def test_parse_policies_reads_entries_and_refuses_bad_ones_by_name():
    assert parse_policies("full, streaming:64,h2o:8,full") == [("full", None), ("streaming", 64), ("h2o", 8)]
    for bad in ("lru:10", "streaming", "streaming:3", "h2o:x", "full:10", ""):
        with pytest.raises(InvalidParameter) as err:
            parse_policies(bad)
        assert err.value.name == "kv-policies", bad


def test_full_perplexity_one_step_at_a_time_equals_one_forward():
    model = tiny_llama().model
    ids = torch.randint(0, 26, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache(1, len(ids))
    logits = model.forward(torch.tensor([ids]), cache)[0]
    cache.release()
    nll = torch.nn.functional.cross_entropy(logits[29:-1], torch.tensor(ids[30:]))
    ppl, peak = perplexity(model, ids, 30)
    assert ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert peak == 79 * model.new_pool(slots=2).bytes_per_slot  # every position but the last one's step


def test_measure_holds_each_policy_to_its_budget():
    loaded = dataclasses.replace(tiny_llama(), tokenizer=_Folded())
    budget = SNAP_WINDOW + 8
    policies = [("full", None), ("streaming", budget), ("h2o", budget), ("snapkv", budget)]
    result = measure(loaded, policies, text_tokens=120, prompt_tokens=60, haystack=100, depths=(0.5,), codes=("12",),
                     speed_tokens=3, repeats=1)
    sides = result["sides"]
    per_token = loaded.model.new_pool(slots=2).bytes_per_slot
    assert sides["full"]["kv_bytes_after_decode"] == (100 + 3) * per_token  # the passage and 3 steps
    for name in ("streaming", "h2o"):
        side = sides[f"{name}:{budget}"]
        assert side["kv_bytes_after_decode"] == budget * per_token
        # the prompt's own forward holds all 60 before the cut; decoding never passes the budget
        assert side["peak_kv_bytes"] == 60 * per_token
    snap = sides[f"snapkv:{budget}"]
    assert snap["kv_bytes_after_decode"] < sides["full"]["kv_bytes_after_decode"]  # the prompt was compressed
    for side in sides.values():
        assert math.isfinite(side["perplexity"]) and side["decode_tok_s"] > 0
    assert sides["full"]["perplexity"] != sides[f"streaming:{budget}"]["perplexity"]  # dropping was felt


def test_measure_refuses_bad_sizes_by_name():
    loaded = dataclasses.replace(tiny_llama(), tokenizer=_Folded())
    with pytest.raises(InvalidParameter, match="prompt_tokens"):
        measure(loaded, [("full", None)], text_tokens=100, prompt_tokens=100)
    with pytest.raises(InvalidParameter, match="text_tokens"):
        measure(loaded, [("full", None)], text_tokens=10**6)
