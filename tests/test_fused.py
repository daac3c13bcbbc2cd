"""The fused CPU decode kernels (metaloom.models.kernels.fused): each kernel against the PyTorch ops it
replaces, a model's one-token steps through them against the same model without them, and a
clear reason (or typed error) where they cannot be had. Every test runs once per instruction-set
path this CPU runs (the ``kernel_path`` fixture)."""

import math
import os
from dataclasses import astuple

import pytest
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LayerWeights, LlamaModel
from metaloom.models.engine.rope import apply_rope, rope_tables
from metaloom.models.kernels.fused import build, kernels, unsupported_reason

CPU = torch.device("cpu")
KERNELS = kernels().kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no fused kernels here: {kernels().reason}")

KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# PyTorch's bfloat16 ops round after every op, the kernels once per output: a few bfloat16 ulps
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within TOL[dtype] of the expected values' scale."""
    return (got.float() - expected.float()).abs().max().item() <= TOL[dtype] * max(1.0, expected.abs().max().item())


@needs
@DTYPES
@pytest.mark.parametrize("with_delta", [False, True])
def test_residual_rms_norm_equals_add_then_rms_norm(with_delta, dtype):
    x = (torch.randn(3, 576, generator=_g(0)) * 3).to(dtype)
    delta = torch.randn(3, 576, generator=_g(1)).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(576, generator=_g(2))).to(dtype)
    expected_x = x + delta if with_delta else x.clone()
    expected_y = F.rms_norm(expected_x, (576,), w, 1e-5)
    y = torch.empty_like(x)
    KERNELS.residual_rms_norm(x, delta, w, y, 1e-5)
    assert torch.equal(x, expected_x)  # the residual add is in place, rounded as PyTorch rounds it
    assert _close(y, expected_y, dtype)


@needs
@DTYPES
def test_silu_mul_equals_torch_including_saturated_gates(dtype):
    gate = torch.randn(2, 64, generator=_g(3)) * 4
    gate[0, :8] = torch.tensor([-1000.0, -100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 1000.0])
    up = torch.randn(2, 64, generator=_g(4))
    gate, up = gate.to(dtype), up.to(dtype)
    y = torch.empty(2, 64, dtype=dtype)
    KERNELS.silu_mul(torch.cat([gate, up], dim=-1), y)
    expected = F.silu(gate.float()) * up.float()
    assert torch.isfinite(y).all()
    assert ((y.float() - expected).abs() <= 1e-6 + TOL[dtype] * expected.abs()).all()


@needs
def test_bfloat16_results_round_to_nearest_even_and_keep_nan():
    # 1 + 2^-8 and 1 + 3 * 2^-8 are ties between bfloat16 neighbours (ulp 2^-7 at 1)
    x = torch.ones(1, 16, dtype=torch.bfloat16)
    delta = torch.tensor([[2**-8, 3 * 2**-8, -(2**-9), float("nan")] * 4], dtype=torch.bfloat16)
    expected = (x.float() + delta.float()).bfloat16()
    assert expected[0, :2].tolist() == [1.0, 1 + 2**-6]  # ties to even
    KERNELS.residual_rms_norm(x, delta, torch.ones(16, dtype=torch.bfloat16), torch.empty_like(x), 1e-5)
    assert torch.equal(x[0, :3], expected[0, :3]) and torch.isnan(x[0, 3])


def _reference_attend(qkv, cos, sin, lengths, table, keys, values, heads, window):
    """The PyTorch ops of LlamaModel._hidden for one token per row: RoPE, the write into the
    new position's slot, then SDPA over the row's keys gathered through its slot table."""
    _, kv_heads, dim = keys.shape
    out = []
    for r in range(len(lengths)):
        pos = int(lengths[r])
        x = qkv[r].view(heads + 2 * kv_heads, 1, dim)[None]  # [1, heads, 1, dim]
        q, k = apply_rope(x[:, :heads + kv_heads], cos[pos][None, None, None], sin[pos][None, None, None]).split(
            [heads, kv_heads], dim=1)
        slot = int(table[r, pos])
        keys[slot] = k[0, :, 0]
        values[slot] = x[0, heads + kv_heads:, 0]
        lo = max(0, pos - window + 1) if window else 0
        index = table[r, lo:pos + 1]
        a = F.scaled_dot_product_attention(q, keys[index].transpose(0, 1)[None], values[index].transpose(0, 1)[None],
                                           enable_gqa=True)
        out.append(a.reshape(heads * dim))
    return torch.stack(out)


@needs
@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (4, 1, 128, None), (2, 2, 96, None),
                                                          (6, 2, 64, 5)])
def test_rope_attend_equals_rope_cache_write_and_sdpa(heads, kv_heads, dim, window, threads, dtype):
    rows, cap, slots = 4, 40, 160
    lengths = torch.tensor([0, 7, 33, 20])  # a fresh row, a short one, one past the window, a fork
    cos, sin = rope_tables(dim, 10000.0, None, 64, dtype, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(5)).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=_g(6)).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=_g(7)).to(dtype)
    # every row's positions at scattered slots; row 3 shares row 2's first 20 (a fork), and each
    # row's new position has a slot of its own
    order = torch.randperm(slots, generator=_g(8))
    table = order[:rows * cap].view(rows, cap).clone()
    table[3, :20] = table[2, :20]
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = _reference_attend(qkv, cos, sin, lengths, table, ref_keys, ref_values, heads, window)
    out = torch.empty(rows, heads * dim, dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, window, threads)
    assert _close(out, expected, dtype)
    assert _close(keys, ref_keys, dtype)  # the rotated key, in each row's new slot
    assert torch.equal(values, ref_values)  # the value, copied


def _long_rows(dtype, heads, kv_heads, dim, lengths, seed):
    """Rows of a long context at scattered slots: qkv, RoPE tables, slot table, keys and values."""
    rows, cap = len(lengths), max(lengths) + 1
    slots = rows * cap
    cos, sin = rope_tables(dim, 10000.0, None, cap, dtype, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(seed)).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=_g(seed + 1)).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=_g(seed + 2)).to(dtype)
    table = torch.randperm(slots, generator=_g(seed + 3)).view(rows, cap).clone()
    return qkv, cos, sin, torch.tensor(lengths), table, keys, values


@needs
@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (4, 1, 128, None), (6, 2, 64, 700)])
def test_a_long_row_attended_in_parts_equals_sdpa(heads, kv_heads, dim, window, threads, dtype):
    """From ATTEND_HALVES (512) positions a row's attention is split into two halves, one task
    each, and the halves' partial softmaxes merged by their log-sum-exp (fused.c, merge_parts):
    whole, whole, in halves from exactly 512 positions, and in halves of 1,301 (of a window of 700
    with one). Dropping a half's weight e^(m_c - M) from the merge, or a half, fails this."""
    qkv, cos, sin, lengths, table, keys, values = _long_rows(dtype, heads, kv_heads, dim, [5, 510, 511, 1300], 40)
    ref_keys, ref_values = keys.clone(), values.clone()
    expected = _reference_attend(qkv, cos, sin, lengths, table, ref_keys, ref_values, heads, window)
    out = torch.empty(len(lengths), heads * dim, dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, window, threads)
    assert _close(out, expected, dtype)


@needs
@DTYPES
def test_a_long_rows_bits_do_not_depend_on_the_threads_or_the_other_rows(dtype):
    """The halves depend only on a row's own positions: the row alone on one thread (a decode
    step) and among other rows on two (a verify's drafted tokens, a batch) give the same bits.
    Speculative decoding's exactness against plain greedy rests on it."""
    heads, kv_heads, dim = 9, 3, 64
    qkv, cos, sin, lengths, table, keys, values = _long_rows(dtype, heads, kv_heads, dim, [1300, 40, 700], 50)
    together = torch.empty(3, heads * dim, dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys.clone(), values.clone(), together, heads, None, 2)
    for r in range(3):
        alone = torch.empty(1, heads * dim, dtype=dtype)
        KERNELS.rope_attend(qkv[r:r + 1].contiguous(), cos, sin, lengths[r:r + 1], table[r:r + 1].contiguous(),
                            keys.clone(), values.clone(), alone, heads, None, 1)
        assert torch.equal(alone[0], together[r])


def _tiny(model_type: str = "llama", **extra) -> LlamaModel:
    """A tiny random model whose sizes the kernels take (multiples of 16, head_dim 32)."""
    torch.manual_seed(0)
    d, inter, heads, kv, vocab = 64, 96, 2, 1, 103
    cfg = LlamaConfig.from_hf({"model_type": model_type, "vocab_size": vocab, "hidden_size": d,
                               "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
                               "num_key_value_heads": kv, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True, **extra})
    sd = {"model.embed_tokens.weight": torch.randn(vocab, d), "model.norm.weight": 1 + 0.1 * torch.randn(d)}
    hd = d // heads
    shapes = {"self_attn.q_proj": (heads * hd, d), "self_attn.k_proj": (kv * hd, d), "self_attn.v_proj": (kv * hd, d),
              "self_attn.o_proj": (d, heads * hd), "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d),
              "mlp.down_proj": (d, inter)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = torch.randn(shape) / math.sqrt(shape[1])
            if cfg.attention_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"):
                sd[p + name + ".bias"] = 0.1 * torch.randn(shape[0])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[p + norm + ".weight"] = 1 + 0.1 * torch.randn(d)
    return LlamaModel.from_state_dict(cfg, sd)


def _as(model: LlamaModel, dtype: torch.dtype) -> LlamaModel:
    """The same tiny model with every tensor in ``dtype``."""
    layers = [LayerWeights(*(None if t is None else t.to(dtype) for t in astuple(w))) for w in model.layers]
    embed = model.embed.to(dtype)
    return LlamaModel(model.config, embed, layers, model.norm.to(dtype), embed)


@needs
@DTYPES
@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "mistral-window"])
def test_fused_steps_equal_pytorch_steps_for_mixed_length_rows(kind, dtype):
    extra = {"qwen2-bias": {"model_type": "qwen2"},
             "mistral-window": {"model_type": "mistral", "sliding_window": 6}}.get(kind, {})
    model_type = extra.pop("model_type", "llama")
    plain = _as(_tiny(model_type, **extra), dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.15}[dtype]  # bfloat16: two layers of rounding differences
    assert unsupported_reason(plain.config, dtype, CPU) is None
    fused = plain.with_fused(KERNELS)
    assert plain.fused is None and fused.fused is KERNELS
    prompts = torch.randint(0, 103, (2, 9), generator=_g(8))
    valid = torch.tensor([9, 4])  # rows of different lengths: per-row positions from here on
    caches = [m.new_cache(2, 40) for m in (plain, fused)]
    outs = [m.forward(prompts, c, valid=valid, last_only=True) for m, c in zip((plain, fused), caches, strict=True)]
    for step in range(14):  # past the sliding window
        token = outs[0][:, -1].argmax(-1, keepdim=True)
        outs = [m.forward_hidden(token, c) for m, c in zip((plain, fused), caches, strict=True)]
        for a, b in zip(outs[0], outs[1], strict=True):  # logits and final hidden states
            assert (a.float() - b.float()).abs().max().item() <= tol * max(1.0, a.abs().max().item()), step
        outs = [o[0] for o in outs]
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    keys = [c.gather(1, 20)[0] for c in caches]  # layer 1's keys of positions 0..19, through the slot tables
    for b, n in enumerate(caches[0].host_lengths().tolist()):  # each row's own positions (past them: padding's slot)
        assert (keys[0][b, :, :n].float() - keys[1][b, :, :n].float()).abs().max().item() <= tol


@needs
def test_fused_model_batch_one_greedy_equals_pytorch_greedy():
    plain = _tiny()
    fused = plain.with_fused(KERNELS)
    tokens = []
    for m in (plain, fused):
        cache = m.new_cache(1, 64)
        logits = m.forward(torch.tensor([[5, 17, 2, 99]]), cache, last_only=True)
        out = []
        for _ in range(40):
            out.append(int(logits[0, -1].argmax()))
            logits = m.forward(torch.tensor([[out[-1]]]), cache)
        tokens.append(out)
    assert tokens[0] == tokens[1]


def test_unsupported_reasons_name_the_problem():
    cfg = _tiny().config
    assert "float32 and bfloat16" in unsupported_reason(cfg, torch.float16, CPU)
    assert "CPU" in unsupported_reason(cfg, torch.float32, torch.device("cuda"))
    odd = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 72, "intermediate_size": 96,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4})
    assert "multiples of 16" in unsupported_reason(odd, torch.float32, CPU)
    small_heads = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 64,
                                       "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
                                       "num_key_value_heads": 4})
    assert "head_dim" in unsupported_reason(small_heads, torch.float32, CPU)


def test_build_without_a_working_compiler_gives_a_reason_not_an_error(tmp_path):
    missing = build(tmp_path, compiler=str(tmp_path / "no-such-cc"))
    assert missing.kernels is None and "no-such-cc" in missing.reason
    broken = build(tmp_path, compiler="/bin/false")
    assert broken.kernels is None and "failed" in broken.reason
    assert not list(tmp_path.rglob("*.so"))  # nothing half-written is left to load later


@needs
def test_build_compiles_once_then_reuses(tmp_path):
    first = build(tmp_path)
    assert first.kernels is not None
    stamp = os.stat(first.kernels.path).st_mtime_ns
    second = build(tmp_path)
    assert second.kernels is not None and second.kernels.path == first.kernels.path
    assert os.stat(second.kernels.path).st_mtime_ns == stamp


def test_load_fused_true_where_it_cannot_run_is_a_typed_error(smollm):
    from metaloom.models import load

    with pytest.raises(InvalidParameter, match="fused"):
        load("default", dtype="float16", fused=True)


@needs
def test_default_float32_load_takes_fused_steps(smollm):
    from metaloom.models import load

    assert smollm.model.fused is not None
    assert load("default", dtype="float32", fused=False).model.fused is None


def test_a_model_that_cannot_take_the_kernels_refuses_them():
    from metaloom.errors import UnsupportedModel

    half = _as(_tiny(), torch.float16)
    with pytest.raises(UnsupportedModel, match="float16"):
        LlamaModel(half.config, half.embed, half.layers, half.norm, half.lm_head, fused=KERNELS)


def test_step_path_says_how_and_why():
    from metaloom.models.kernels.fused import step_path

    plain = _tiny()
    assert step_path(object()).startswith("PyTorch ops: object is not the native model")
    if KERNELS is not None:
        assert step_path(plain.with_fused(KERNELS)) == "fused kernels"
        assert step_path(plain) == "PyTorch ops: turned off (fused=False)"
    assert "float16" in step_path(_as(plain, torch.float16))


class _Counting:
    """Real kernels that count their calls."""

    def __init__(self, kernels):
        self.kernels, self.calls = kernels, 0

    def __getattr__(self, name):
        def call(*args):
            self.calls += 1
            return getattr(self.kernels, name)(*args)
        return call


def test_a_decode_step_over_a_few_hundred_keys_splits_its_attention():
    """scripts/attention_threads.py: from about 250 (row, key) pairs a split over threads pays
    (a one-token step at 300 positions 5-8% faster), and below it the split is level. With the
    old threshold (2048) a step or a 2- to 6-token verify at a few hundred positions stayed on one
    thread while the other waited."""
    from metaloom.models.engine.fused_step import attention_threads

    assert attention_threads(1, 299, 2) == 2  # one row, 300 keys: a decode step
    assert attention_threads(4, 99, 8) == 8  # a 4-token verify after 96 positions
    assert attention_threads(1, 120, 2) == 1  # too little to pay for the parallel regions
    assert attention_threads(2, 30, 2) == 1
    assert attention_threads(1, 10**6, 1) == 1  # one thread available


@needs
@pytest.mark.parametrize("parallel_from", [10**9, 0])  # one thread; every step split over threads
def test_fused_steps_over_forked_rows_equal_pytorch_steps(monkeypatch, parallel_from):
    import metaloom.models.engine.fused_step as fused_step

    monkeypatch.setattr(fused_step, "PARALLEL_MIN_KEYS", parallel_from)
    plain = _tiny()
    counting = _Counting(KERNELS)
    fused = LlamaModel(plain.config, plain.embed, plain.layers, plain.norm, plain.lm_head, fused=counting)
    prompt = torch.randint(0, 103, (1, 9), generator=_g(9))
    caches, outs = [], []
    for m in (plain, fused):
        cache = m.new_cache(1, 40)
        out = m.forward(prompt, cache, last_only=True)
        forked = cache.fork([0, 0, 0])  # three rows sharing the prompt's slots
        cache.release()
        caches.append(forked)
        outs.append(out.expand(3, -1, -1))
    assert counting.calls > 0  # the prompt took the kernels' rows too (fused_step.prefill_keys)
    assert caches[1].pool.used_slots == 9  # the fork copied no keys
    for step in range(6):
        token = torch.tensor([[3], [50], [77]]) if step == 0 else outs[0][:, -1].argmax(-1, keepdim=True)
        before = counting.calls
        outs = [m.forward(token, c) for m, c in zip((plain, fused), caches, strict=True)]
        assert counting.calls > before
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
    assert caches[1].pool.used_slots == 9 + 3 * 6


@needs
@DTYPES
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (14, 2, 64), (8, 2, 128), (17, 1, 64)])
def test_a_group_attended_at_once_gives_each_heads_own_bits(heads, kv_heads, dim, dtype):
    """Grouped-query attention reads each key once for the group's query heads (group_attend in
    fused.c, 16 query heads at a time): each head's output must be, bit for bit,
    what the same head gives with a kv head of its own (the model with its kv heads repeated,
    one query head per group)."""
    rows, cap, slots, group = 3, 48, 160, heads // kv_heads
    lengths = torch.tensor([0, 29, 41])
    cos, sin = rope_tables(dim, 10000.0, None, 64, dtype, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(15)).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=_g(16)).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=_g(17)).to(dtype)
    table = torch.randperm(slots, generator=_g(18))[:rows * cap].view(rows, cap).clone()
    q, k, v = qkv.view(rows, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=1)
    mha_qkv = torch.cat([q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)], 1).reshape(rows, -1)
    mha_keys, mha_values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out, mha_out = (torch.empty(rows, heads * dim, dtype=dtype) for _ in range(2))
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, None, 1)
    KERNELS.rope_attend(mha_qkv.contiguous(), cos, sin, lengths, table, mha_keys, mha_values, mha_out, heads, None, 1)
    assert torch.equal(out, mha_out)


@needs
@DTYPES
@pytest.mark.parametrize("positions", [1, 8, 13, 29])
def test_a_key_scores_the_same_bits_in_a_block_of_eight_and_alone(positions, dtype):
    """Float keys are scored 8 at a time, their lane sums added across by shuffles (hsum8x8 in
    fused.c), and the last few one at a time (hsum): both must sum in one order. With every
    key the same vector, every score must then be the same float: each softmax numerator is
    exactly 1 and the output is exactly the values' sum, in position order, times 1 / n. One
    score a rounding apart makes its numerator e^(-ulp) != 1."""
    heads, kv_heads, dim, slots = 9, 3, 64, 64
    cos, sin = torch.ones(64, dim, dtype=dtype), torch.zeros(64, dim, dtype=dtype)  # RoPE as the identity
    g = _g(21)
    key = torch.randn(kv_heads, dim, generator=g) * torch.logspace(-2, 2, dim)  # terms of many magnitudes
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=g) * 3
    qkv.view(heads + 2 * kv_heads, dim)[heads:heads + kv_heads] = key  # the new key: the same vector
    qkv = qkv.to(dtype)
    keys = key.to(dtype).expand(slots, kv_heads, dim).contiguous()
    values = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    table = torch.randperm(slots, generator=g)[:positions + 1][None].clone()
    out = torch.empty(1, heads * dim, dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, torch.tensor([positions]), table, keys, values, out, heads, None, 1)
    v = values[table[0]].float()  # [positions + 1, kv_heads, dim], the new value written in its slot
    total = torch.zeros(kv_heads, dim)
    for t in range(positions + 1):  # the kernel's order: one position after another
        total = total + v[t]
    expected = (total * torch.tensor(1.0 / (positions + 1), dtype=torch.float32)).repeat_interleave(
        heads // kv_heads, 0).reshape(1, -1).to(dtype)
    assert torch.equal(out, expected)
