"""Static-shape decode steps (`metaloom.models.engine.graphs`), run uncaptured on the CPU: the
same code the GPU captures as CUDA graphs. Each step must give the model's own forward's
logits for every row, through forks, finished rows, rows of different lengths, caches written
by multi-token forwards between steps, and a pool that grows under it."""

from __future__ import annotations

import logging

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.engine import graphs, static_step
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.testing.tiny import random_weights


def _tiny(**extra) -> LlamaModel:
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 103, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                               **extra})
    return LlamaModel.from_state_dict(cfg, random_weights(cfg))


def _mode(monkeypatch, value: str) -> None:
    monkeypatch.setenv("METALOOM_CUDA_GRAPHS", value)


@pytest.fixture(params=["torch", "triton"])
def kernels(request, monkeypatch):
    """The static step with PyTorch ops, and with Triton's fused kernels under Triton's
    interpreter (float32 on the CPU: the code the GPU compiles)."""
    if request.param == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # before triton's first import (tests/conftest.py)
        pytest.importorskip("triton")
        monkeypatch.setenv("METALOOM_TRITON", "on")
    else:
        monkeypatch.setenv("METALOOM_TRITON", "off")
    return request.param


def _check_kernels(model, kernels: str) -> None:
    """The steps ran with the kernels asked for."""
    stats = model.step_graph_stats()
    assert (stats["triton_steps"] > 0) == (kernels == "triton") and stats["triton_failures"] == []


def _pair(model, monkeypatch, script):
    """Run ``script(model, pool, step)`` twice, eager and static; return both logs of the kept
    rows' logits (a finished row's, valid 0, are never read)."""
    logs = []
    for mode in ("off", "on"):
        _mode(monkeypatch, mode)
        pool = model.new_pool(slots=8)  # small: it grows during the run
        log: list[torch.Tensor] = []

        def step(cache, tokens, valid=None, log=log):
            logits = model.forward(tokens, cache, valid=valid)[:, -1]
            log.append(logits if valid is None else logits[valid.bool()])
            return logits

        script(model, pool, step, log)
        logs.append(log)
    return logs


BIAS = {"attention_bias": True, "model_type": "qwen2"}
WINDOW = {"sliding_window": 5, "model_type": "mistral"}


# Triton's kernels are not run with the bias (PyTorch's linear adds it before them; 30 s of
# interpreter saved): the plain and sliding-window shapes cover them
@pytest.mark.parametrize("extra,kernels", [({}, "torch"), (BIAS, "torch"), (WINDOW, "torch"),
                                           ({}, "triton"), (WINDOW, "triton")], indirect=["kernels"])
def test_static_steps_give_the_eager_logits(monkeypatch, extra, kernels):
    model = _tiny(**extra)

    def script(model, pool, step, log):
        rng = torch.Generator().manual_seed(1)
        prompts = [[5, 9, 2, 7, 1], [3, 4], [8, 8, 8, 1, 2, 6, 0, 9]]
        cache = model.new_cache(3, 40, pool)
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
        logits = model.forward(tokens, cache, valid=torch.tensor([len(p) for p in prompts]), last_only=True)[:, -1]
        nxt = logits.argmax(-1)
        for i in range(6):  # rows of different lengths; row 1 finishes after step 3
            valid = torch.tensor([1, 0 if i > 3 else 1, 1])
            nxt = step(cache, nxt[:, None], valid).argmax(-1)
        forked = cache.fork([0, 0, 2, 1, 0])  # shared prefixes, read through the table
        cache.release()
        nxt = torch.randint(0, 103, (5,), generator=rng)
        for _ in range(4):
            nxt = step(forked, nxt[:, None]).argmax(-1)
        # a speculative verify between steps (3 tokens a row, causal within them), rolled back
        valid = torch.tensor([3, 1, 2, 3, 0])
        block = model.forward(torch.randint(0, 103, (5, 3), generator=rng), forked, valid=valid)
        log.extend(block[b, :int(valid[b])] for b in range(5))
        forked.truncate(forked.lengths - torch.tensor([1, 0, 1, 0, 0]))
        for _ in range(3):
            nxt = step(forked, nxt[:, None]).argmax(-1)

    eager, static = _pair(model, monkeypatch, script)
    assert len(eager) == len(static) == 18
    for a, b in zip(eager, static, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    stats = model.step_graph_stats()
    # 13 one-token steps and the verify; the table uploaded on first use and for the fork only
    # (the verify's writes are mirrored by the step itself)
    assert stats["steps"] == 14 and stats["uploads"] == 2 and stats["failures"] == []
    _check_kernels(model, kernels)


def test_static_steps_cross_key_buckets_and_row_buckets(monkeypatch, kernels):
    model = _tiny()

    def script(model, pool, step, log):
        cache = model.new_cache(3, 300, pool)
        prompts = torch.randint(0, 103, (3, 120), generator=torch.Generator().manual_seed(2))
        model.forward(prompts, cache, valid=torch.tensor([120, 100, 60]))
        nxt = torch.tensor([1, 2, 3])
        for _ in range(12):  # 121 -> 133 keys: across the first key bucket (128)
            nxt = step(cache, nxt[:, None]).argmax(-1)

    eager, static = _pair(model, monkeypatch, script)
    for a, b in zip(eager, static, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    _check_kernels(model, kernels)


def _ancestors(parents: list[int], width: int) -> torch.Tensor:
    """[W, W] bool: node i attends itself and its ancestors; nodes past the tree attend only themselves."""
    mask = torch.eye(width, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def test_token_tree_verify_blocks_take_the_static_step(monkeypatch, kernels):
    """A token-tree verify block (each node at the row's length plus its depth, attending its
    ancestors) gives the eager forward's logits through the static step, and the steps after
    it, once the rejected nodes are rolled back, still do."""
    model = _tiny()
    trees = [[-1, 0, 0, 1, 2], [-1, 0, 1], [-1, -1, 0, 1, 1]]  # a branching tree, a chain (2 of 5 padded), two roots

    def script(model, pool, step, log):
        rng = torch.Generator().manual_seed(4)
        cache = model.new_cache(3, 40, pool)
        model.forward(torch.randint(0, 103, (3, 7), generator=rng), cache, valid=torch.tensor([7, 4, 6]))
        nxt = torch.tensor([1, 2, 3])
        for _ in range(2):
            nxt = step(cache, nxt[:, None]).argmax(-1)
        tree = torch.stack([_ancestors(p, 5) for p in trees])
        valid = torch.tensor([len(p) for p in trees])
        block = model.forward(torch.randint(0, 103, (3, 5), generator=rng), cache, valid=valid, tree=tree)
        log.extend(block[b, :int(valid[b])] for b in range(3))
        cache.truncate(cache.lengths - torch.tensor([3, 1, 4]))  # keep a path's first nodes, as an acceptance does
        for _ in range(3):
            nxt = step(cache, nxt[:, None]).argmax(-1)

    eager, static = _pair(model, monkeypatch, script)
    assert len(eager) == len(static) == 8
    for a, b in zip(eager, static, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert model.step_graph_stats()["steps"] == 6  # 5 one-token steps and the tree block
    _check_kernels(model, kernels)


def test_buckets_and_mode(monkeypatch):
    assert [graphs.row_bucket(n) for n in (1, 2, 3, 5, 9, 13, 256)] == [1, 2, 4, 8, 12, 16, 256]
    assert graphs.row_bucket(257) is None
    sizes = [graphs.key_bucket(n) for n in (1, 128, 129, 193, 257, 385, 513, 769, 1025)]
    assert sizes == [128, 128, 192, 256, 384, 512, 768, 1024, 1536]
    assert all(graphs.key_bucket(n) < 1.5 * n + 1 for n in range(128, 5000, 37))
    _mode(monkeypatch, "sometimes")
    with pytest.raises(InvalidParameter, match="METALOOM_CUDA_GRAPHS"):
        graphs.mode()
    _mode(monkeypatch, "off")
    model = _tiny()
    assert model.step_graphs(model.new_pool()) is None
    _mode(monkeypatch, "auto")  # auto on the CPU: the fused kernels' path, no static step
    assert model.step_graphs(model.new_pool()) is None
    _mode(monkeypatch, "on")
    assert model.step_graphs(model.new_pool()) is not None


def test_a_capture_that_fails_falls_back_and_says_why(monkeypatch, caplog):
    model = _tiny()
    _mode(monkeypatch, "on")
    pool = model.new_pool()
    runner = model.step_graphs(pool)
    cache = model.new_cache(2, 20, pool)
    model.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache)
    expected_cache = cache.fork([0, 1])

    def broken(rows, keys, width, triton):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner.capture = True  # as on a GPU, but every capture fails
    monkeypatch.setattr(runner, "_capture", broken)
    with caplog.at_level(logging.WARNING):
        got = model.forward(torch.tensor([[7], [8]]), cache)[:, -1]
    assert "capture failed" in caplog.text and "operation not permitted" in caplog.text
    assert runner.failure is not None and not runner.capture
    assert any("operation not permitted" in f for f in model.step_graph_stats()["failures"])
    _mode(monkeypatch, "off")
    want = model.forward(torch.tensor([[7], [8]]), expected_cache)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_generator_gives_the_same_tokens_with_static_steps(monkeypatch):
    """The real default model through the decode loop: greedy and seeded samples (rows that
    stop early, several samples per request) are the same tokens with the static step."""
    from metaloom.generator import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.models import load
    from metaloom.sampling import SamplingParams

    loaded = load("default", dtype="float32", weights="dense", pack=False, fused=False)
    requests = [Request("Write a haiku about the sea.", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16)),
                Request("Count to five:", SamplingParams(temperature=0, max_tokens=12)),
                Request("Name a color.", SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=9, max_tokens=20,
                                                        stop=("\n",)))]
    outs = []
    for mode in ("off", "on"):
        _mode(monkeypatch, mode)
        out = LocalGenerator(loaded, prefill_overhead_tokens=16).generate(requests, ledger=Ledger())
        outs.append([[c.token_ids for c in o] for o in out])
    assert outs[0] == outs[1]
    assert loaded.model.step_graph_stats()["steps"] >= 15  # the static step ran

    # speculative decoding: the verify forwards (pending + drafts) take the static step too
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.ngram import NgramDrafter

    text = "The cat sat on the mat. The cat sat on the mat. The cat"
    spec = [Request(text, SamplingParams(temperature=0, max_tokens=12)),
            Request(text, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8))]
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    # a chain (n-gram) and token trees (Token Recycling, static 3.2.1); a fresh drafter each time
    # (Token Recycling learns across requests, and sampled tokens depend on the drafts)
    for make, k in ((NgramDrafter, 4), (lambda: RecyclingDrafter(TreeShape((3, 2, 1))), 12)):
        outs = []
        for mode in ("off", "on"):
            _mode(monkeypatch, mode)
            before = loaded.model.step_graph_stats()["steps"]
            gen = LocalGenerator(loaded, speculative=Speculative(make(), num_draft=k), prefill_overhead_tokens=16)
            outs.append([[c.token_ids for c in o] for o in gen.generate(spec, ledger=Ledger())])
            ran = loaded.model.step_graph_stats()["steps"] - before
            assert (ran > 0) == (mode == "on")
        assert outs[0] == outs[1], make


def test_failing_triton_kernels_fall_back_to_pytorch_ops_and_say_why(monkeypatch, caplog):
    model = _tiny()
    _mode(monkeypatch, "on")
    monkeypatch.setenv("METALOOM_TRITON", "on")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr("metaloom.models.kernels.gpu_triton._installed", lambda: True)  # whether or not it is
    pool = model.new_pool()
    runner = model.step_graphs(pool)
    cache = model.new_cache(2, 20, pool)
    model.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache)
    expected_cache = cache.fork([0, 1])
    tried = []

    def broken(rows, keys, width, triton):
        tried.append(triton)
        raise RuntimeError("out of resources: shared memory" if triton else "capture unsupported here")

    runner.capture = True  # as on a GPU: Triton's step fails, then the PyTorch step's capture
    monkeypatch.setattr(runner, "_capture", broken)
    with caplog.at_level(logging.WARNING):
        got = model.forward(torch.tensor([[7], [8]]), cache)[:, -1]
    assert tried == [True, False]
    assert "Triton decode kernels failed" in caplog.text and "out of resources" in caplog.text
    stats = model.step_graph_stats()
    assert stats["triton_steps"] == 0 and any("out of resources" in f for f in stats["triton_failures"])
    assert not runner.triton()  # for good: the next steps do not try again
    _mode(monkeypatch, "off")
    want = model.forward(torch.tensor([[7], [8]]), expected_cache)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_triton_kernels_run_up_to_triton_rows_and_pytorch_ops_above(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    monkeypatch.setenv("METALOOM_TRITON", "on")
    monkeypatch.setattr(graphs, "TRITON_ROWS", 2)
    model = _tiny()
    _mode(monkeypatch, "on")
    pool = model.new_pool()
    cache = model.new_cache(3, 20, pool)
    model.forward(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), cache)
    model.forward(torch.tensor([[1], [2], [3]]), cache)  # 3 rows: bucket 4, PyTorch ops
    assert model.step_graph_stats()["steps"] == 1 and model.step_graph_stats()["triton_steps"] == 0
    two = cache.fork([0, 2])
    got = model.forward(torch.tensor([[4], [5]]), two)[:, -1]  # bucket 2: Triton's kernels
    assert model.step_graph_stats()["steps"] == 2 and model.step_graph_stats()["triton_steps"] == 1
    _mode(monkeypatch, "off")
    want = model.forward(torch.tensor([[4], [5]]), cache.fork([0, 2]))[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_cuda_device_this_machine_lacks_is_a_typed_error(monkeypatch):
    from metaloom.models.load import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(InvalidParameter, match="device"):
            pick_device(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(InvalidParameter, match=r"cuda:0 \.\. cuda:1"):
        pick_device("cuda:2")
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(InvalidParameter):
        pick_device("tpu")


def test_a_pool_the_device_cannot_hold_is_cache_full(monkeypatch):
    from metaloom.errors import CacheFull
    from metaloom.models.engine.pool import KVPool

    pool = KVPool(2, 2, 8, torch.float32, slots=4)
    zeros = torch.zeros

    def scarce(shape, *args, **kwargs):
        if shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return zeros(shape, *args, **kwargs)

    monkeypatch.setattr(torch, "zeros", scarce)
    with pytest.raises(CacheFull, match="out of memory"):
        pool.allocate(6)
    assert pool.slots == 4 and pool.allocate(3).tolist() == [1, 2, 3]  # nothing lost
    with pytest.raises(CacheFull, match="does not fit"):
        KVPool(2, 2, 8, torch.float32, slots=100)


def test_two_threads_stepping_one_pool_take_turns(monkeypatch):
    """The static buffers are shared by a pool's steps: two threads decoding their own caches
    in one pool (a scoring call beside the server's loop) get what each gets alone."""
    import threading

    model = _tiny()

    def decode(pool, first, out, start=None):
        cache = model.new_cache(2, 80, pool)
        nxt = model.forward(torch.tensor([[first, 3, 4], [5, first, 6]]), cache)[:, -1].argmax(-1)
        if start is not None:
            start.wait()
        for _ in range(30):
            logits = model.forward(nxt[:, None], cache)[:, -1]
            out.append(logits)
            nxt = logits.argmax(-1)

    _mode(monkeypatch, "off")
    alone = {f: [] for f in (1, 2)}
    for f in (1, 2):
        decode(model.new_pool(), f, alone[f])
    _mode(monkeypatch, "on")
    pool, start = model.new_pool(slots=512), threading.Barrier(2)
    together = {f: [] for f in (1, 2)}
    threads = [threading.Thread(target=decode, args=(pool, f, together[f], start)) for f in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in (1, 2):
        assert len(together[f]) == 30
        for a, b in zip(alone[f], together[f], strict=True):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert model.step_graph_stats()["steps"] == 60


def test_the_mixed_triton_step_attends_through_pytorch_above_paged_rows(monkeypatch):
    """Above PAGED_ROWS one-token rows take gather + SDPA inside the Triton step: the same logits
    as the eager forward, and the step is still counted as Triton's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    monkeypatch.setenv("METALOOM_TRITON", "on")
    monkeypatch.setenv("METALOOM_TRITON_ROWS", "64")
    monkeypatch.setattr(static_step, "PAGED_ROWS", 2)
    called = []
    from metaloom.models.kernels import gpu_triton

    real = gpu_triton.paged_attend
    monkeypatch.setattr(gpu_triton, "paged_attend", lambda *a, **k: called.append(1) or real(*a, **k))
    model = _tiny()
    _mode(monkeypatch, "on")
    pool = model.new_pool()
    cache = model.new_cache(3, 20, pool)
    model.forward(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), cache)
    other = cache.fork([0, 1, 2])
    got = model.forward(torch.tensor([[1], [2], [3]]), cache)[:, -1]  # bucket 4 > PAGED_ROWS
    assert model.step_graph_stats()["triton_steps"] == 1 and called == []
    _mode(monkeypatch, "off")
    want = model.forward(torch.tensor([[1], [2], [3]]), other)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_triton_rows_must_be_a_positive_integer(monkeypatch):
    monkeypatch.setenv("METALOOM_TRITON_ROWS", "0")
    with pytest.raises(InvalidParameter, match="METALOOM_TRITON_ROWS"):
        graphs.triton_rows()
    monkeypatch.setenv("METALOOM_TRITON_ROWS", "48")
    assert graphs.triton_rows() == 48
