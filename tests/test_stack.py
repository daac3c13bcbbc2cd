"""Every layer of a one-token step in one C call (`metaloom.models.engine.stack`, fused.c's
``decode_layers``): the same bits as the model's Python loop over the same kernels, for native
quantised weights (float32 and bfloat16 activations), metaloom's own bfloat16 products, a model
with a q/k/v bias, forked rows of different lengths; and the Python loop where the call does not
apply. Every test runs once per instruction-set path this CPU runs."""

from __future__ import annotations

import pytest
import torch

from metaloom.models import load
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import Concat, LlamaModel
from metaloom.models.kernels import fused, quant
from metaloom.models.kernels.packed import Bf16Linear
from metaloom.testing.tiny import random_weights

pytestmark = pytest.mark.usefixtures("kernel_path")


def _on_path(model: LlamaModel) -> LlamaModel:
    """``model`` with the fused kernels of the path under test (the quantised ones are looked up
    per call)."""
    k = fused.kernels().kernels
    if k is None or quant.kernels().kernels is None:
        pytest.skip("no kernels here")
    return model.with_fused(k)


def _steps(model: LlamaModel, prompts: list[list[int]], tokens: list[list[int]], python_loop: bool,
           monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Prefill each prompt into one cache (rows of different lengths; row 1 forked from row 0's
    prefix), then one-token steps of ``tokens`` for every row; the logits of each step."""
    with monkeypatch.context() as m:
        if python_loop:
            m.setattr(model, "_plan", lambda rows: None)
        pool = model.new_pool()
        caches = [model.new_cache(1, 64, pool) for _ in prompts]
        for cache, ids in zip(caches, prompts, strict=True):
            model.forward(torch.tensor([ids]), cache)
        fork = caches[0].fork([0])
        model.forward(torch.tensor([[7]]), fork)
        out = []
        for step in tokens:
            row_logits = [model.forward(torch.tensor([[t]]), c) for t, c in zip(step, [*caches, fork], strict=True)]
            out.append(torch.cat(row_logits))
        return out


def _batched(model: LlamaModel, prompt: list[int], steps: int, python_loop: bool,
             monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Three rows in one batch (one cache), greedy steps: the batched form of the one-call step."""
    with monkeypatch.context() as m:
        if python_loop:
            m.setattr(model, "_plan", lambda rows: None)
        cache = model.new_cache(3, 64)
        ids = torch.tensor([prompt, prompt[::-1], [5] * len(prompt)])
        logits = model.forward(ids, cache)[:, -1:]
        out = []
        for _ in range(steps):
            logits = model.forward(logits.argmax(-1), cache)
            out.append(logits)
        return out


@pytest.fixture(scope="module")
def native32():
    return load("default", dtype="float32", weights="native").model


@pytest.fixture(scope="module")
def native16():
    return load("default", dtype="bfloat16", weights="native").model


def test_one_call_equals_the_python_loop_bit_for_bit_on_native_weights(native32, native16, monkeypatch):
    prompts = [[1, 42, 17, 99, 1234, 5], [1, 8, 9]]
    tokens = [[11, 22, 33], [44, 55, 66], [77, 88, 99]]
    for model in (_on_path(native32), _on_path(native16)):
        assert model._plan(1) is not None
        ours = _steps(model, prompts, tokens, False, monkeypatch)
        loop = _steps(model, prompts, tokens, True, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))
        ours = _batched(model, prompts[0], 4, False, monkeypatch)
        loop = _batched(model, prompts[0], 4, True, monkeypatch)
        assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))


def test_one_call_with_own_bfloat16_products_and_a_qkv_bias(monkeypatch):
    """A tiny Qwen-like model (q/k/v bias), its weights as metaloom's own bfloat16 products
    (`Bf16Linear`), and as quantised Q8_0 / Q4_1 blocks (GGUF layout and panels), and q/k/v of
    two types (a `Concat`: each part's outputs side by side, one row or three)."""
    cfg = LlamaConfig.from_hf({"model_type": "qwen2", "vocab_size": 101, "hidden_size": 128, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    sd = random_weights(cfg, seed=0)
    own = LlamaModel.from_state_dict(cfg, sd, dtype=torch.bfloat16).own_bf16()
    assert isinstance(own.layers[0].qkv, Bf16Linear) and own.layers[0].qkv_bias is not None
    for qtype in ("Q8_0", "Q4_1", "mixed"):  # mixed: v in Q8_0 beside q and k in Q4_1, as GGUFs do
        blocks = {k: quant.quantize(v, "Q8_0" if qtype == "mixed" and "v_proj" in k else qtype.replace("mixed", "Q4_1"))
                  for k, v in sd.items() if k.endswith("proj.weight")}
        native = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32, blocks=blocks)
        if qtype == "mixed":
            assert isinstance(native.layers[0].qkv, Concat) and len(native.layers[0].qkv.parts) == 3
        else:
            assert native.layers[0].qkv.layout == ("panel" if qtype == "Q4_1" else "gguf")
        for model in (_on_path(own), _on_path(native)):
            assert model._plan(1) is not None
            ours = _batched(model, [1, 2, 3, 4], 3, False, monkeypatch)
            loop = _batched(model, [1, 2, 3, 4], 3, True, monkeypatch)
            assert all(torch.equal(a, b) for a, b in zip(ours, loop, strict=True))


def test_the_python_loop_stays_where_the_call_does_not_apply(smollm, native32):
    dense = _on_path(smollm.model)  # float32 dense weights: PyTorch's GEMMs, not the quantised kernels
    assert dense._plan(1) is None
    model = _on_path(native32)
    assert model._plan(quant.CROSSOVER_ROWS) is not None and model._plan(quant.CROSSOVER_ROWS + 1) is None
