"""int8 (and bfloat16) KV pools, ``--kv-dtype`` (issue 31 item 2): exact codes and scales on
hand-made vectors, the dequantisation error bound, attention and logits against a float pool
within bounds derived from the scales, forks / truncation / moves / growth keeping the scales
with their codes, the memory a slot takes, and the flags with their refusals."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.engine import graphs
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.kv_int8 import dequantize, quantize
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.pool import KVPool, storage_dtype
from metaloom.models.kernels.fused import kernels
from metaloom.testing.tiny import random_weights

FUSED = kernels().kernels
needs_fused = pytest.mark.skipif(FUSED is None, reason=f"no fused kernels here: {kernels().reason}")
INT8 = EngineOptions(kv_dtype="int8")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tiny(dtype: torch.dtype = torch.float32, **extra) -> LlamaModel:
    """Two layers, head_dim 32 (sizes the fused kernels take), 4 query heads over 2 kv heads."""
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 103, "hidden_size": 128, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                               **extra})
    sd = {k: v.to(dtype) for k, v in random_weights(cfg).items()}
    return LlamaModel.from_state_dict(cfg, sd, dtype=dtype)


def _decode(model: LlamaModel, steps: int = 30, rows: int = 2, seed: int = 0,
            forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``rows`` prompts of different lengths, then greedy steps (or the ``forced``
    tokens [B, steps]): (logits [steps, B, V] after each step, tokens [B, steps] fed)."""
    cache = model.new_cache(rows, 64)
    prompts = torch.randint(0, 103, (rows, 9), generator=_g(seed))
    valid = torch.tensor([9, 5, 7, 3][:rows])
    logits = model.forward(prompts, cache, valid=valid, last_only=True)
    out, tokens = [], []
    for i in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]
        tokens.append(token)
        logits = model.forward(token, cache)
        out.append(logits[:, -1])
    return torch.stack(out), torch.cat(tokens, dim=1)


# --- quantisation: exact on hand-made vectors ------------------------------------------------------------

def test_quantize_hand_made_vectors_exactly():
    # max |x| 127: scale exactly 1, so the codes are x rounded half to even (torch.round)
    x = torch.tensor([[127.0, -127.0, 63.5, 62.5, 0.5, 1.5, -2.5, 0.0]])
    codes, scale = quantize(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == [1.0]
    assert codes.tolist() == [[127, -127, 64, 62, 0, 2, -2, 0]]
    assert torch.equal(dequantize(codes, scale, torch.float32), torch.tensor([[127.0, -127, 64, 62, 0, 2, -2, 0]]))
    # the largest magnitude lands on ±127 whatever the scale (never -128)
    y = torch.tensor([[-3.0, 1.0, 0.25], [1e-30, -5e-31, 0.0], [6.0e4, 3.0e4, -6.0e4]])
    codes, scale = quantize(y)
    assert codes[:, 0].tolist() == [-127, 127, 127] and codes[2, 2] == -127
    assert int(codes.min()) >= -127
    assert torch.allclose(scale, y.abs().amax(-1) / 127, rtol=0, atol=0)


def test_a_zero_vector_gets_scale_zero_and_reads_back_zero_not_nan():
    x = torch.zeros(3, 2, 8)
    x[1, 1, 3] = -2.0  # one vector that is not zero beside zero ones
    codes, scale = quantize(x)
    assert scale[0].tolist() == [0.0, 0.0] and scale[1, 1] == 2.0 / 127
    assert not codes[0].any() and codes[1, 1, 3] == -127
    back = dequantize(codes, scale, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and not torch.isnan(back).any()
    assert not back[0].any() and back[1, 1, 3] == -2.0


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 300.0, 1e5])
def test_every_element_reads_back_within_half_a_scale(magnitude):
    # |x - q s| <= s/2 from rounding x/s to an integer; the float division x/s (|x/s| <= 127) and
    # the product q s each add at most 127 s 2^-24: the bound is s (1/2 + 254 * 2^-24)
    x = torch.randn(500, 3, 64, generator=_g(1)) * magnitude
    x[::7, :, 5] *= 40  # outlier channels, as real keys have
    codes, scale = quantize(x)
    err = (dequantize(codes, scale, torch.float32) - x).abs()
    bound = scale[..., None] * (0.5 + 254 * 2.0**-24)
    assert (err <= bound).all()
    assert (err.amax(-1) > 0.3 * scale).any()  # the bound is nearly met: it is the rounding, not slack


def test_attention_over_dequantised_keys_within_the_bound_from_the_scales():
    # out = sum_t p_t v_t. With keys off by dk_t, each score moves by at most
    # delta = max_t |q . dk_t| / sqrt(D) <= sum|q| max(s_k) / (2 sqrt D), so each p'_t / p_t is in
    # [e^-2delta, e^2delta] and |p' - p|_1 <= e^(2 delta) - 1; with values off by dv_t:
    # |out' - out| <= max_t |dv_t| + (e^(2 delta) - 1) max |v|
    d, length = 64, 50
    q = torch.randn(1, 1, 1, d, generator=_g(2))
    k = torch.randn(1, 1, length, d, generator=_g(3)) * 2
    v = torch.randn(1, 1, length, d, generator=_g(4))
    k[..., 7] *= 20
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    k2, v2 = dequantize(kq, ks, torch.float32), dequantize(vq, vs, torch.float32)
    exact = F.scaled_dot_product_attention(q, k, v)
    approx = F.scaled_dot_product_attention(q, k2, v2)
    delta = ((k2 - k) @ q.transpose(-1, -2)).abs().max().item() / math.sqrt(d)
    assert delta <= q.abs().sum().item() * ks.max().item() / (2 * math.sqrt(d))
    bound = (v2 - v).abs().max().item() + math.expm1(2 * delta) * v.abs().max().item()
    err = (approx - exact).abs().max().item()
    assert 0 < err <= bound + 1e-6


# --- the model: int8 and float pools ------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2])  # one row reads its run of slots in place in a float pool: not in int8
def test_the_int8_pool_reads_exactly_the_dequantised_keys(monkeypatch, rows):
    """An int8 model's logits equal, bit for bit, a float32 model's whose pool was handed
    dequantize(quantize(k)) for every key and value: the pool stores codes and scales and
    gathers them back, nothing else."""
    model = _tiny()
    got = _decode(model.with_options(INT8), rows=rows)
    write = PagedKVCache.write

    def rounded_write(self, layer, k, v, slots):
        (kq, ks), (vq, vs) = quantize(k.transpose(1, 2)), quantize(v.transpose(1, 2))
        k2 = dequantize(kq, ks, k.dtype).transpose(1, 2)
        v2 = dequantize(vq, vs, v.dtype).transpose(1, 2)
        write(self, layer, k2, v2, slots)

    monkeypatch.setattr(PagedKVCache, "write", rounded_write)
    expected = _decode(model, rows=rows)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[0], expected[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_logits_close_to_the_float_pool_and_greedy_agrees_off_near_ties(seed):
    # Each kv element is off by at most s/2 = max|x| / 254 (a 2^-8 relative error of its
    # vector's largest element): attention passes at most that of the values and, through the
    # scores, e^(2 delta) - 1 (the bound above). Over two layers and an LM head of unit-gain
    # random weights that is a few times 2^-8 of the logits' scale: 2% (5 x 2^-8) bounds it.
    # bfloat16 storage rounds each element to 2^-9 of itself: tighter, and checked the same way.
    # Both runs are fed the float run's greedy tokens, so every step compares the same context;
    # the argmax then agrees wherever the float top-two margin is more than twice the error.
    model = _tiny()
    base_logits, base_tokens = _decode(model, seed=seed)
    top2 = base_logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]  # [steps, B]
    for kv, tol in (("int8", 0.02), ("bfloat16", 0.01)):
        logits, _ = _decode(model.with_options(EngineOptions(kv_dtype=kv)), seed=seed, forced=base_tokens)
        err = (logits - base_logits).abs().max().item()
        assert 0 < err <= tol * base_logits.abs().max().item(), kv
        clear = margin > 2 * err
        assert clear.float().mean() > 0.8  # most steps are not near-ties: the check below has teeth
        assert torch.equal(logits.argmax(-1)[clear], base_logits.argmax(-1)[clear]), kv


@pytest.mark.parametrize("fused", [False, True])
def test_kv_dtype_float32_on_a_float32_model_is_todays_default_bit_for_bit(fused):
    model = _tiny()
    if fused:
        if FUSED is None:
            pytest.skip("no fused kernels here")
        model = model.with_fused(FUSED)
    explicit = model.with_options(EngineOptions(kv_dtype="float32"))
    assert explicit.new_pool().dtype == torch.float32
    assert explicit.fused_reads(explicit.new_pool())  # the fused step, where the model has it
    a, b = _decode(model, steps=40), _decode(explicit, steps=40)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_bfloat16_model_with_int8_kv_reads_keys_in_bfloat16():
    model = _tiny(torch.bfloat16).with_options(INT8)
    cache = model.new_cache(1, 32)
    assert (cache.pool.dtype, cache.pool.compute_dtype) == (torch.int8, torch.bfloat16)
    logits = model.forward(torch.tensor([[1, 2, 3, 4]]), cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    k, v = cache.gather(0, 4)
    assert k.dtype == v.dtype == torch.bfloat16 and k.shape == (1, 2, 4, 32)


@needs_fused
def test_a_fused_model_with_an_int8_pool_steps_as_the_pytorch_path_does():
    """A model with fused kernels and an int8 pool takes its one-token steps (the fused step
    where it reads int8, else the PyTorch one) and gives the PyTorch path's logits to float
    rounding."""
    plain = _tiny().with_options(INT8)
    fused = plain.with_fused(FUSED)
    a, b = _decode(plain, rows=3), _decode(fused, rows=3)
    assert torch.equal(a[1], b[1])
    assert (a[0] - b[0]).abs().max().item() <= 1e-4 * max(1.0, a[0].abs().max().item())


# --- the pool: forks, truncation, moves, growth ---------------------------------------------------------

def _filled(model: LlamaModel, pool: KVPool | None = None) -> PagedKVCache:
    cache = model.new_cache(2, 40, pool)
    model.forward(torch.randint(0, 103, (2, 12), generator=_g(5)), cache, valid=torch.tensor([12, 8]))
    return cache


def test_a_forked_row_reads_the_same_dequantised_keys_and_scales_stay_with_their_slots():
    model = _tiny().with_options(INT8)
    cache = _filled(model)
    forked = cache.fork([1, 0, 1])
    assert cache.pool.used_slots == 20  # the fork copied no keys
    for layer in range(2):
        k, v = cache.gather(layer, 12)
        fk, fv = forked.gather(layer, 12)
        assert torch.equal(fk[0, :, :8], k[1, :, :8]) and torch.equal(fv[2, :, :8], v[1, :, :8])
        assert torch.equal(fk[1], k[0]) and torch.equal(fv[1], v[0])
    # the fork goes on: its new keys go to new slots with their own scales; the parent's stay
    before = [t.clone() for t in cache.gather(1, 12)]
    model.forward(torch.tensor([[4], [5], [6]]), forked)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.gather(1, 12), strict=True))


def test_truncate_then_rewrite_reads_the_new_keys_with_their_new_scales():
    model = _tiny().with_options(INT8)
    cache = _filled(model)
    model.forward(torch.tensor([[7], [8]]), cache)
    cache.truncate([12, 8])  # drops the step: its slots are free again
    model.forward(torch.tensor([[70], [80]]), cache)  # other tokens, at the same positions
    fresh = _filled(model)
    model.forward(torch.tensor([[70], [80]]), fresh)
    for layer in range(2):
        for a, b in zip(cache.gather(layer, 13), fresh.gather(layer, 13), strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1, :, :9], b[1, :, :9])


def _kept(cache: PagedKVCache) -> list[torch.Tensor]:
    """Every layer's keys and values of each row's own positions (not the stale ones past its length)."""
    n = cache.host_lengths()
    out = []
    for layer in range(cache.pool.layers):
        k, v = cache.gather(layer, int(n.max()))
        out += [t[b, :, :int(n[b])] for t in (k, v) for b in range(cache.batch)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_moved_to_and_a_growing_pool_keep_codes_and_scales():
    model = _tiny().with_options(INT8)
    small = model.new_pool(slots=2)  # grows while the prompt is written, to exactly the 21 slots it needs
    cache = _filled(model, small)
    expected = _kept(cache)
    assert _same(expected, _kept(_filled(model)))  # the grown pool reads what a roomy one does
    assert small.slots == 21
    model.forward(torch.tensor([[3], [4]]), cache)  # needs two more: grows again, copying codes and scales
    assert small.slots > 21 and all(s.shape[0] == small.slots for s in small.key_scales + small.value_scales)
    cache.truncate([12, 8])
    assert _same(expected, _kept(cache))
    other = model.new_pool()
    moved = cache.moved_to(other)
    assert other.used_slots == 20 and _same(expected, _kept(moved))
    with pytest.raises(InvalidParameter, match="pool"):  # codes into a float pool would be read as numbers
        moved.moved_to(_tiny().new_pool())
    with pytest.raises(InvalidParameter, match="kv dtype"):  # nor may a float model take an int8 pool
        _tiny().new_cache(1, 8, other)


def test_bytes_per_slot_counts_the_scales_smollm2_shape():
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64; keys and values, per token
    layers, heads, dim = 30, 3, 64
    sizes = {d: KVPool(layers, heads, dim, d, slots=4).bytes_per_slot for d in (torch.float32, torch.bfloat16, torch.int8)}
    assert sizes[torch.float32] == 2 * layers * heads * dim * 4 == 46080
    assert sizes[torch.bfloat16] == 23040
    assert sizes[torch.int8] == 2 * layers * heads * (dim + 4) == 12240  # a float32 scale per vector
    from metaloom.server.memory import kv_pool_bytes

    pool = KVPool(layers, heads, dim, torch.int8, slots=4)
    assert kv_pool_bytes(pool) == pool.slots * pool.bytes_per_slot  # what /metrics reports


def test_pool_and_storage_dtype_validation():
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype("int8", torch.bfloat16) == torch.int8
    with pytest.raises(InvalidParameter, match="kv_dtype"):
        storage_dtype("int4", torch.float32)
    with pytest.raises(InvalidParameter, match="kv_dtype"):
        EngineOptions(kv_dtype="fp8")
    with pytest.raises(InvalidParameter, match="dtype"):
        KVPool(1, 1, 32, torch.int32)
    assert KVPool(1, 1, 32, torch.int8).compute_dtype == torch.float32  # the default for int8 storage
    assert KVPool(1, 1, 32, torch.bfloat16).key_scales == []  # a float pool has no scales


def test_the_static_step_refuses_a_pool_it_cannot_read(monkeypatch):
    monkeypatch.setenv("METALOOM_CUDA_GRAPHS", "on")  # the static step, uncaptured on the CPU
    model = _tiny()
    assert graphs.why_not(model) is None
    int8 = model.with_options(INT8)
    why = graphs.why_not(int8)
    assert why is not None and "int8" in why
    assert graphs.why_not(model, int8.new_pool()) is not None
    assert int8.step_graphs(int8.new_pool()) is None
    cache = int8.new_cache(1, 16)
    int8.forward(torch.tensor([[1, 2, 3]]), cache)
    logits = int8.forward(torch.tensor([[4]]), cache)  # eager, not a static step over int8 codes
    assert int8.step_graph_stats()["steps"] == 0
    monkeypatch.setenv("METALOOM_CUDA_GRAPHS", "off")
    again = int8.new_cache(1, 16)
    int8.forward(torch.tensor([[1, 2, 3]]), again)
    assert torch.equal(logits, int8.forward(torch.tensor([[4]]), again))


# --- flags, load and refusals ---------------------------------------------------------------------------

def _args(*argv: str, remote: bool = True) -> argparse.Namespace:
    from metaloom.commands.common import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p, remote=remote)
    return p.parse_args(list(argv))


def test_flags_parse_with_auto_defaults_and_match_the_options():
    from metaloom.commands.common import KV_DTYPES, SHARED_PREFIX_MODES, engine_options
    from metaloom.models.engine import options

    assert (KV_DTYPES, SHARED_PREFIX_MODES) == (options.KV_DTYPES, options.SHARED_PREFIX_MODES)
    assert engine_options(_args()) == {"kv_dtype": "auto", "shared_prefix_attention": "auto"}
    got = engine_options(_args("--kv-dtype", "int8", "--shared-prefix-attention", "off"))
    assert got == {"kv_dtype": "int8", "shared_prefix_attention": "off"}
    EngineOptions(**got)  # what load builds from them
    with pytest.raises(SystemExit):
        _args("--kv-dtype", "int4")


@pytest.mark.parametrize(("argv", "flag"), [(["--kv-dtype", "int8"], "kv-dtype"),
                                            (["--shared-prefix-attention", "on"], "shared-prefix-attention")])
def test_remote_backend_refuses_the_engine_flags_by_name(argv, flag):
    from metaloom.commands.common import remote_generator
    from metaloom.commands.evaluate import register, setup_of

    args = _args("--backend", "openai", "--base-url", "http://127.0.0.1:9", *argv)
    with pytest.raises(InvalidParameter) as err:
        remote_generator(args)
    assert err.value.name == flag and "--backend openai" in str(err.value)
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    eval_args = p.parse_args(["eval", "--task", "jsonl:x.jsonl", "--strategies", "greedy", "--out", "x",
                              "--backend", "openai", "--base-url", "http://127.0.0.1:9", *argv])
    with pytest.raises(InvalidParameter) as err:
        setup_of(eval_args)
    assert err.value.name == flag


def test_load_refuses_engine_options_for_the_transformers_backend(smollm):
    from metaloom.models import load

    for name, value in (("kv_dtype", "int8"), ("shared_prefix_attention", "on")):
        with pytest.raises(InvalidParameter) as err:
            load("default", backend="transformers", **{name: value})
        assert err.value.name == name and "transformers" in str(err.value)
    with pytest.raises(InvalidParameter, match="kv_dtype"):
        load("default", kv_dtype="fp8")


def test_load_applies_the_kv_dtype_to_the_native_model(smollm):
    from metaloom.models import load

    loaded = load("default", dtype="float32", weights="dense", pack=False, kv_dtype="int8")
    model = loaded.model
    assert isinstance(model, LlamaModel) and model.options == INT8
    pool = model.new_pool(slots=4)
    assert (pool.dtype, pool.compute_dtype) == (torch.int8, torch.float32)
    assert pool.bytes_per_slot == 12240
    assert smollm.model.new_pool(slots=4).dtype == torch.float32  # auto: the model's dtype
