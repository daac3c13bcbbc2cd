"""Native weights (`metaloom.models.engine.native`): the default model's GGUF blocks kept as they are
and multiplied by the quantised kernels, against the same weights dequantised. The tests of the
arithmetic run once per instruction-set path this CPU runs (``on_path``: the quantised and the
fused kernels of that path)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models import load
from metaloom.models.engine.llama import Concat, LlamaModel
from metaloom.models.engine.native import Choice, blocks_dir, blocks_path, choose, read_blocks, recorded_choice
from metaloom.models.kernels.quant import QuantWeight

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "def fibonacci(n):",
           "List three prime numbers greater than 50.", "Explain gravity to a child."]
Q4_1, Q8_0 = 3, 8


@pytest.fixture(scope="module")
def native(smollm):
    return load("default", dtype="float32", weights="native")


@pytest.fixture
def on_path(native, kernel_path):
    """``native`` running the kernels of the path under test: the quantised ones are looked up per
    call, the fused ones are bound to the model, so rebound here."""
    from metaloom.models.kernels import fused, quant

    f, q = fused.kernels().kernels, quant.kernels().kernels
    if f is None or q is None:
        pytest.skip(f"no kernels for {kernel_path}")
    assert f.isa == q.isa == kernel_path
    return dataclasses.replace(native, model=native.model.with_fused(f))


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(ids) + 1)
    return model.forward(torch.tensor([ids]), cache)[0].float()


def test_native_load_keeps_the_files_blocks(native, smollm):
    assert native.weights == "native" and smollm.weights == "dense"
    m = native.model
    assert isinstance(m, LlamaModel)
    layer = m.layers[0]
    # q, k, v are all Q4_1 in this file: one fused matmul over their concatenated blocks
    assert isinstance(layer.qkv, QuantWeight) and layer.qkv.qtype == Q4_1
    assert layer.qkv.shape == (960, 576) and layer.gate_up.shape == (3072, 576)
    assert isinstance(m.embed, QuantWeight) and m.embed.qtype == Q8_0
    assert m.lm_head is m.embed  # tied: one table, quantised once
    assert m.num_parameters() == smollm.model.num_parameters()
    # 0.625 bytes per Q4_1 weight: the whole model is far smaller than in float32
    kept = sum(w.blocks.numel() for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert kept * 6 < 4 * sum(t.numel() for t in (layer.qkv, layer.o, layer.gate_up, layer.down))


def test_blocks_file_is_written_once_and_reused(native):
    path = blocks_path("unused: already converted", native.folder)  # exists: the GGUF is not read again
    assert path == os.path.join(native.folder, blocks_dir(), "model.safetensors")  # named by the kept types
    before = os.path.getmtime(path)
    again = load("default", dtype="float32", weights="native")
    assert os.path.getmtime(path) == before
    sd, kept = read_blocks(path)
    assert "model.layers.0.self_attn.q_proj.weight" in kept and "model.norm.weight" in sd
    assert torch.equal(again.model.layers[3].down.blocks, native.model.layers[3].down.blocks)


def test_native_logits_match_the_dequantised_model(on_path, smollm):
    """Same weights, so the logits agree to float rounding (the kernels sum in another order)."""
    tok = smollm.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False)
        ours, ref = _logits(on_path.model, ids), _logits(smollm.model, ids)
        scale = ref.abs().max()
        assert (ours - ref).abs().max() <= 2e-4 * scale, prompt


def test_native_one_token_steps_match_dense(on_path, smollm):
    """The decode path (one token per step, fused kernels, the quantised matvec)."""
    ids = smollm.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    caches = [m.new_cache(1, len(ids) + 8) for m in (on_path.model, smollm.model)]
    for m, c in zip((on_path.model, smollm.model), caches, strict=True):
        m.forward(torch.tensor([ids]), c)
    for t in (11, 22, 33, 44):
        a = on_path.model.forward(torch.tensor([[t]]), caches[0])[0, -1]
        b = smollm.model.forward(torch.tensor([[t]]), caches[1])[0, -1]
        assert (a - b).abs().max() <= 2e-4 * b.abs().max()


def test_native_greedy_tokens_match_dense(on_path, smollm):
    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [Request(({"role": "user", "content": p},), params) for p in PROMPTS]
    ours = LocalGenerator(on_path).generate(reqs, ledger=Ledger())
    ref = LocalGenerator(smollm).generate(reqs, ledger=Ledger())
    for a, b in zip(ours, ref, strict=True):
        assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 24


def test_native_bfloat16_activations(smollm, kernel_path):
    bf = load("default", dtype="bfloat16", weights="native")  # loaded on the path: its fused kernels too
    assert bf.model.dtype == torch.bfloat16 and isinstance(bf.model.layers[0].o, QuantWeight)
    # a prompt of 23 tokens: it takes the fused kernels' rows as a one-token step would, whose
    # first position, computed from one key, moved 8% of the scale on "Once upon a time" (the
    # PyTorch ops' 3%), while over these 23 positions they agree as closely as those ops do
    text = "The quick brown fox jumps over the lazy dog. It was a sunny day in the small village, and everyone was"
    ids = smollm.tokenizer.encode(text, add_special_tokens=False)
    ours, ref = _logits(bf.model, ids), _logits(smollm.model, ids)
    # bfloat16 activations: 8 bits of mantissa, so agreement to a few percent of the scale
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
    assert ours[-1].argmax() == ref[-1].argmax()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_mixed_types_stack_into_a_concat():
    from metaloom.models.engine.llama import stack
    from metaloom.models.kernels.quant import quantize

    w = torch.randn(64, 64)
    a, b = quantize(w[:32], Q8_0), quantize(w[32:], 2)  # Q8_0 and Q4_0
    both = stack([a, b])
    assert isinstance(both, Concat)
    x = torch.randn(3, 64)
    assert torch.allclose(both(x), torch.cat([a(x), b(x)], -1))
    same = stack([a, quantize(w[32:], Q8_0)])
    assert isinstance(same, QuantWeight) and same.shape == (64, 64)
    assert torch.allclose(same(x), torch.cat([a(x), quantize(w[32:], Q8_0)(x)], -1), atol=1e-6)


def test_bad_weights_are_typed_errors(smollm, tmp_path):
    with pytest.raises(InvalidParameter, match="weights"):
        load("default", weights="int3")
    with pytest.raises(InvalidParameter, match="not a GGUF"):
        load(smollm.folder, weights="native")  # a transformers folder has no blocks
    with pytest.raises(InvalidParameter, match="transformers backend"):
        load("default", weights="native", backend="transformers")
    with pytest.raises(InvalidParameter, match="float16"):
        load("default", weights="native", dtype="float16")
    # dense always works, on any model
    assert load(smollm.folder, weights="dense").weights == "dense"


class _Sleepy:
    """A model whose one-token step takes ``step`` seconds (for the choice's measurement)."""

    def __init__(self, step: float) -> None:
        self.step, self.device, self.steps = step, torch.device("cpu"), 0

    def new_cache(self, batch: int, capacity: int) -> None:
        return None

    def forward(self, tokens: torch.Tensor, cache: object, last_only: bool = False) -> torch.Tensor:
        if tokens.shape[1] == 1:
            self.steps += 1
            time.sleep(self.step)
        return torch.zeros(1, tokens.shape[1], 5)


@pytest.fixture
def quiet(monkeypatch):
    """The machine as the choice sees it: no other work (the suite's own load must not decide)."""
    from metaloom.models.engine import native as native_mod

    monkeypatch.setattr(native_mod, "others_per_core", lambda: 0.0)


def test_auto_choice_is_measured_once_and_recorded(tmp_path, quiet):
    path = str(tmp_path / "choice.json")
    calls = []

    def models():
        calls.append(1)
        return _Sleepy(0.004), _Sleepy(0.0005)  # native slower here

    first = choose(path, "float32", models, tokens=4, repeats=3)
    assert first.weights == "dense" and first.dense_tok_s > first.native_tok_s
    with open(path) as f:
        assert json.load(f)["weights"] == "dense"
    second = choose(path, "float32", models, tokens=4, repeats=3)
    assert second == first and len(calls) == 1  # recorded: not measured again

    faster = str(tmp_path / "other.json")
    assert choose(faster, "float32", lambda: (_Sleepy(0.0005), _Sleepy(0.004)), tokens=4).weights == "native"


def test_a_choice_measured_on_a_busy_machine_is_used_but_not_recorded(tmp_path, monkeypatch):
    from metaloom.models.engine import native as native_mod

    path, calls = str(tmp_path / "choice.json"), []
    load = iter([0.1, 3.0, 3.0, 3.0])  # quiet before the first timing, busy after it; busy throughout the second

    def models():
        calls.append(1)
        return _Sleepy(0.0005), _Sleepy(0.004)

    monkeypatch.setattr(native_mod, "others_per_core", lambda: next(load))
    first = choose(path, "float32", models, tokens=4, repeats=1)
    assert first.weights == "native" and first.others_per_core == 3.0 and not os.path.exists(path)
    choose(path, "float32", models, tokens=4, repeats=1)
    assert len(calls) == 2 and not os.path.exists(path)  # measured again, still not kept


def test_a_record_from_before_the_load_was_noted_is_measured_again(tmp_path, quiet):
    path = tmp_path / "choice.json"
    path.write_text(json.dumps({"weights": "dense", "native_tok_s": 10.2, "dense_tok_s": 13.6, "dtype": "float32",
                                "threads": 2, "tokens": 24, "repeats": 3}))
    assert recorded_choice(str(path)) is None
    assert choose(str(path), "float32", lambda: (_Sleepy(0.0005), _Sleepy(0.004)), tokens=4).weights == "native"
    assert json.loads(path.read_text())["weights"] == "native"


def test_a_corrupt_choice_record_is_measured_again(tmp_path, quiet):
    path = tmp_path / "choice.json"
    path.write_text("{not json")
    assert recorded_choice(str(path)) is None
    path.write_text(json.dumps({"weights": "sparse", "native_tok_s": 1, "dense_tok_s": 1, "dtype": "float32",
                                "threads": 2, "tokens": 4, "repeats": 1, "others_per_core": 0.0}))
    assert recorded_choice(str(path)) is None
    c = choose(str(path), "float32", lambda: (_Sleepy(0.0005), _Sleepy(0.004)), tokens=4, repeats=1)
    assert isinstance(c, Choice) and c.weights == "native"


def test_auto_default_loads_what_was_recorded(tmp_path, monkeypatch, smollm):
    """load(weights=None) follows the recorded choice for this file, dtype and machine."""
    import importlib

    from metaloom.models.engine import native as native_mod
    from metaloom.models.find import default_model_path, fingerprint

    find_mod = importlib.import_module("metaloom.models.find")
    monkeypatch.setenv("METALOOM_CACHE", str(tmp_path))
    # the converted folders stay where they are: only choices/ moves under tmp_path
    monkeypatch.setattr(find_mod, "cache_root", lambda: os.path.dirname(smollm.folder))
    path = native_mod.choice_path(fingerprint(default_model_path()), "float32")
    for weights in ("native", "dense"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"weights": weights, "native_tok_s": 1.0, "dense_tok_s": 1.0, "dtype": "float32",
                       "threads": 2, "tokens": 4, "repeats": 1, "others_per_core": 0.0}, f)
        loaded = load("default")
        assert loaded.weights == weights
        assert isinstance(loaded.model.layers[0].down, QuantWeight) == (weights == "native")


def test_cli_generate_with_native_weights():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([METALOOM, "generate", "What is 2 + 2?", "--weights", "native",
                           "--temperature", "0", "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["completions"][0]["tokens"] and out["usage"]["output_tokens"] == len(out["completions"][0]["tokens"])
    bad = subprocess.run([METALOOM, "generate", "hi", "--weights", "native",
                          "--backend", "openai", "--base-url", "http://127.0.0.1:9"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "weights" in bad.stderr


def test_blocks_are_written_whole_or_not_at_all(tmp_path):
    from metaloom.models.find import default_model_path
    from metaloom.models.paths import write_folder

    path = blocks_path(default_model_path(), str(tmp_path))
    assert os.listdir(tmp_path) == [blocks_dir()]  # no temporary folder left behind
    _, kept = read_blocks(path)
    assert kept["model.layers.0.mlp.down_proj.weight"].qtype == Q4_1  # type: ignore[attr-defined]

    def fails(tmp: str) -> None:
        with open(os.path.join(tmp, "half-written"), "w") as f:
            f.write("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_folder(str(tmp_path / "other"), ".x-", fails)
    assert os.listdir(tmp_path) == [blocks_dir()]


def test_speculator_heads_draft_from_quantised_embedding_and_head(native):
    """The heads read the target's embedding and head rows, decoded from the blocks; greedy
    output stays the target's own."""
    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.heads import HeadsDrafter

    req = Request(({"role": "user", "content": PROMPTS[0]},), SamplingParams(temperature=0, max_tokens=24,
                                                                            ignore_eos=True))
    plain = LocalGenerator(native).generate([req], ledger=Ledger())[0][0]
    ledger = Ledger()
    drafted = LocalGenerator(native, speculative=Speculative(HeadsDrafter(), 4)).generate([req], ledger=ledger)[0][0]
    assert drafted.token_ids == plain.token_ids
    assert ledger.usage.accepted_tokens > 0  # the heads' drafts are used, not all rejected


def test_first_auto_load_measures_records_and_returns_the_measured_model(tmp_path, monkeypatch, smollm):
    import importlib

    find_mod = importlib.import_module("metaloom.models.find")
    monkeypatch.setenv("METALOOM_CACHE", str(tmp_path))  # no choice recorded yet
    monkeypatch.setattr(find_mod, "cache_root", lambda: os.path.dirname(smollm.folder))
    # a quiet machine: on a busy one (a background sweep) the measurement is rightly not recorded
    monkeypatch.setattr(importlib.import_module("metaloom.models.engine.native"), "others_per_core", lambda: 0.0)
    loaded = load("default")
    records = os.listdir(tmp_path / "choices")
    assert len(records) == 1
    with open(tmp_path / "choices" / records[0]) as f:
        choice = json.load(f)
    assert loaded.weights == choice["weights"] and choice["native_tok_s"] > 0 and choice["dense_tok_s"] > 0
    assert isinstance(loaded.model.layers[0].down, QuantWeight) == (loaded.weights == "native")
