"""`metaloom bench activations`: q8 against float activations on the default model's native
weights, each figure from its own side."""

from __future__ import annotations

import math

import pytest

from metaloom.bench import activations
from metaloom.errors import InvalidParameter


def test_shared_prefix_counts_up_to_the_first_difference():
    assert activations.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert activations.common_prefix([1, 2], [1, 2, 3]) == 2
    assert activations.common_prefix([5], [6]) == 0


@pytest.fixture(scope="module")
def measured():
    from metaloom.models import load

    loaded = load("default", dtype="float32", weights="native")
    return activations.measure(loaded, rows=[1, 4], context=16, steps=2, samples=2, sample_tokens=4,
                               text_tokens=64, greedy_tokens=8, repeats=1)


def test_each_side_has_its_own_figures(measured):
    float_side, q8 = measured["sides"]["float"], measured["sides"]["q8"]
    for side in (float_side, q8):
        for prefix in ("", "shared_"):  # each row its own prompt's keys; rows forked from one prefill
            steps, width = side[f"{prefix}step_seconds"], side[f"{prefix}width_ratio"]
            assert set(steps) == {"1", "4"} and width["1"] == 1.0 and width["4"] == steps["4"] / steps["1"]
        assert side["samples_tok_s"] == 2 * 4 / side["samples_seconds"]
        assert math.isfinite(side["perplexity"]) and side["perplexity"] > 1
    # the same weights, different arithmetic: close perplexities, not the same number
    assert float_side["perplexity"] != q8["perplexity"]
    assert abs(q8["perplexity"] / float_side["perplexity"] - 1) < 0.1
    g = measured["greedy"]
    assert len(g["prompts"]) == len(activations.PROMPTS) and all(0 <= p["shared_prefix"] <= 8 for p in g["prompts"])
    assert g["identical"] == sum(p["shared_prefix"] == 8 for p in g["prompts"]) / len(g["prompts"])


@pytest.mark.parametrize("shared", [False, True])
def test_a_shared_step_prefills_once_and_forks_the_rows(shared):
    """``shared``: one prompt prefilled once, its keys forked to every row (samples of one prompt,
    a verify's tokens); else each row prefills its own copy (a batch of requests)."""
    from metaloom.models import load

    model = load("default", dtype="float32", weights="native").model
    shapes, forks, forward, new_cache = [], [], model.forward, model.new_cache

    def spy_cache(*args, **kwargs):
        cache = new_cache(*args, **kwargs)
        fork = cache.fork
        cache.fork = lambda rows: forks.append(list(rows)) or fork(rows)
        return cache

    model.forward = lambda ids, cache, *a, **k: shapes.append(tuple(ids.shape)) or forward(ids, cache, *a, **k)
    model.new_cache = spy_cache
    try:
        assert activations.step_seconds(model, 3, 5, 2, shared) > 0
    finally:
        del model.forward, model.new_cache
    assert shapes == ([(1, 5)] if shared else [(3, 5)]) + [(3, 1)] * 2
    assert forks == ([[0, 0, 0]] if shared else [])


def test_dense_weights_are_refused_naming_the_flag(smollm):
    with pytest.raises(InvalidParameter, match="weights"):
        activations.measure(smollm, rows=[1], context=4, steps=1, samples=1, sample_tokens=1, text_tokens=8,
                            greedy_tokens=1, repeats=1)
