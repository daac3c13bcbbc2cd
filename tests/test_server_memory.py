"""Memory accounting on /metrics and KV pool sizing (issue 30)."""

from __future__ import annotations

import httpx2 as httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from metaloom.generator import LocalGenerator
from metaloom.prefix import PrefixCache
from metaloom.server.app import create_app
from metaloom.server.memory import (
    kv_pool_bytes,
    kv_pool_limit,
    meminfo,
    prefix_budget,
    process_rss,
    size_pools,
    storage_bytes,
    storage_parts,
)
from metaloom.testing.served import serve_app
from metaloom.testing.tiny import tiny_llama


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10, 4)  # 160 bytes
    view = a[2:5]
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    arr = np.zeros(7, dtype=np.int64)  # 56 bytes

    class Holder:
        def __init__(self) -> None:
            self.items = [a, view, {"x": b, "again": a}]
            self.array, self.slice = arr, arr[2:]
            self.me = self

    assert storage_bytes(Holder()) == 160 + 24 + 56
    assert storage_bytes([]) == 0


def test_storage_bytes_counts_opaque_tensors_by_their_elements():
    # oneDNN's packed weights (the dense bf16/f32 linear layers) have no storage to ask
    packed = torch.zeros(8, 16).to_mkldnn()
    held = {"w": packed, "same": packed, "b": torch.zeros(4)}
    assert storage_bytes(held) == 8 * 16 * 4 + 16
    assert storage_parts(held) == {"plain": 16, "packed": 8 * 16 * 4}


def test_the_weights_figure_is_the_model_tensors():
    loaded = tiny_llama()
    m = loaded.model
    expected = 4 * m.num_parameters() + sum(t.untyped_storage().nbytes() for t in (m._cos, m._sin))
    assert storage_bytes(m) == expected


def test_kv_pool_limit_follows_the_rule():
    per = 46_080  # SmolLM2-135M, float32: 2 * 30 layers * 3 heads * 64 * 4 bytes
    # rows: 64 full windows of 8192 fit neither 24 GB nor 2 GB
    assert kv_pool_limit(per, 64, 8192, 24 << 30) == int(0.5 * (24 << 30)) // per
    assert kv_pool_limit(per, 64, 8192, 2 << 30) == (1 << 30) // per
    assert kv_pool_limit(per, 4, 256, 24 << 30) == 4 * 256 + 1  # a small server needs no more than its rows
    assert kv_pool_limit(per, 4, 256, 24 << 30, fraction=1e-9) == 2
    assert kv_pool_limit(100, 1, 1000, 10_000, fraction=0.25) == 25
    with pytest.raises(ValueError):
        kv_pool_limit(0, 1, 1, 1)
    assert prefix_budget(1 << 30, 512 << 20) == 256 << 20
    assert prefix_budget(10, 512 << 20) == 10


def test_size_pools_bounds_the_pool_and_the_prefix_cache():
    gen = LocalGenerator(tiny_llama(), prefix_cache=PrefixCache(budget_bytes=1 << 30))
    per = gen.pool.bytes_per_slot
    size_pools(gen, max_rows=4, available=1 << 40)
    assert gen.pool.max_slots == 4 * gen.model.max_context + 1
    assert gen.prefix_cache.budget_bytes == gen.pool.max_slots * per // 2
    size_pools(gen, max_rows=4, available=200 * per)
    assert gen.pool.max_slots == 100 and gen.prefix_cache.budget_bytes == 50 * per


def test_meminfo_and_rss_read_proc():
    assert meminfo("MemTotal") > meminfo("MemAvailable") > 0
    assert process_rss() > 50 << 20


def _gauges(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "metaloom_memory_bytes":
            out.update({s.labels["part"]: s.value for s in family.samples})
    return out


def test_metrics_say_what_holds_memory():
    gen = LocalGenerator(tiny_llama(), prefix_cache=PrefixCache(budget_bytes=1 << 20))
    app = create_app(gen, model_ids=["default"], max_rows=8)
    with serve_app(app) as url:
        before = _gauges(httpx.get(url + "/metrics", timeout=30).text)
        assert set(before) == {"weights", "weights_packed", "kv_pool", "kv_pool_used", "kv_pool_limit", "prefix_cache",
                               "process_rss"}
        assert before["weights"] == storage_bytes(gen.model) and before["weights_packed"] == 0  # float32 tiny: plain
        assert before["kv_pool"] == kv_pool_bytes(gen.pool) == gen.pool.slots * gen.pool.bytes_per_slot
        body = {"model": "default", "prompt": "abcabc", "n": 4, "max_tokens": 100, "temperature": 1, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        after = _gauges(httpx.get(url + "/metrics", timeout=30).text)
    assert after["kv_pool"] == gen.pool.slots * gen.pool.bytes_per_slot > before["kv_pool"]  # it grew
    assert after["prefix_cache"] == gen.prefix_cache.used_bytes > 0
    assert after["prefix_cache"] <= after["kv_pool_used"] <= after["kv_pool"] <= after["kv_pool_limit"]
    assert after["kv_pool_limit"] == gen.pool.max_slots * gen.pool.bytes_per_slot
    assert after["process_rss"] > after["weights"] + after["kv_pool_used"]
