"""The fused CPU kernels over an int8 KV pool (``--kv-dtype int8``): `rope_attend` writes the new
key and value as the same codes and scales as the Python pool's write (round half to even, a
zero vector to scale 0) and attends the dequantised pool, per row and with shared-prefix
attention; a model's fused one-token steps (the Python loop over the kernels, and every layer
in one `decode_layers` call) give the PyTorch path's int8 logits to float rounding. Every test
runs once per instruction-set path this CPU runs (the ``path_kernels`` fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.kv_int8 import dequantize, quantize
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.rope import apply_rope, rope_tables
from metaloom.models.engine.sharing import find_sharing
from metaloom.models.kernels import quant
from metaloom.models.kernels.fused import kernels
from metaloom.testing.tiny import random_weights
from tests.test_fused import _as, _Counting, _tiny

CPU = torch.device("cpu")
KERNELS = kernels().kernels
KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")
INT8 = EngineOptions(kv_dtype="int8")
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the kernels dequantise to float32 and fold the scale into the dot product; the PyTorch path
# dequantises to the activations' dtype (rounding each key to bfloat16 in a bfloat16 model)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(slots: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random keys and values already in int8: (key codes, key scales, value codes, value scales)."""
    (kq, ks), (vq, vs) = (quantize(torch.randn(slots, kv_heads, dim, generator=_g(seed + i))) for i in range(2))
    return kq, ks, vq, vs


def _reference(qkv, cos, sin, lengths, table, pool, heads, window, dtype):
    """What the PyTorch path does: rotate q and k (rounded to ``dtype``), write k and v through
    kv_int8.quantize, attend over the dequantised keys and values (in float32)."""
    kq, ks, vq, vs = pool
    _, kv_heads, dim = kq.shape
    out = []
    for r in range(len(lengths)):
        pos = int(lengths[r])
        x = qkv[r].view(heads + 2 * kv_heads, 1, dim)[None]
        q, k = apply_rope(x[:, :heads + kv_heads], cos[pos][None, None, None], sin[pos][None, None, None]).split(
            [heads, kv_heads], dim=1)
        slot = int(table[r, pos])
        (kq[slot], ks[slot]), (vq[slot], vs[slot]) = quantize(k[0, :, 0]), quantize(x[0, heads + kv_heads:, 0])
        lo = max(0, pos - window + 1) if window else 0
        index = table[r, lo:pos + 1]
        keys = dequantize(kq[index], ks[index], torch.float32).transpose(0, 1)[None]
        values = dequantize(vq[index], vs[index], torch.float32).transpose(0, 1)[None]
        out.append(F.scaled_dot_product_attention(q.float(), keys, values, enable_gqa=True).reshape(heads * dim))
    return torch.stack(out)


def _attend(qkv, cos, sin, lengths, table, pool, heads, window, threads, dtype, sharing=None):
    kq, ks, vq, vs = pool
    out = torch.empty(len(lengths), heads * kq.shape[2], dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, kq, vq, out, heads, window, threads, sharing, (ks, vs))
    return out


@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(9, 3, 64, None), (4, 1, 128, None), (2, 2, 96, None),
                                                          (6, 2, 64, 5)])
def test_rope_attend_int8_writes_python_codes_and_attends_the_dequantised_pool(heads, kv_heads, dim, window,
                                                                               threads, dtype):
    rows, cap, slots = 4, 40, 161  # slot 0 (scratch) unused
    lengths = torch.tensor([0, 7, 33, 20])  # a fresh row (RoPE at position 0 is exact), a short one, a long one, a fork
    cos, sin = rope_tables(dim, 10000.0, None, 64, dtype, CPU)
    qkv = (3 * torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(5))).to(dtype)
    order = torch.randperm(slots - 1, generator=_g(8)) + 1
    table = order[:rows * cap].view(rows, cap).clone()
    table[3, :20] = table[2, :20]
    pool = _pool(slots, kv_heads, dim, 6)
    ref = tuple(t.clone() for t in pool)
    expected = _reference(qkv, cos, sin, lengths, table, ref, heads, window, dtype)
    got = _attend(qkv, cos, sin, lengths, table, pool, heads, window, threads, dtype)
    assert (got.float() - expected).abs().max().item() <= TOL[dtype] * max(1.0, expected.abs().max().item())
    new = table[torch.arange(rows), lengths]
    kq, ks, vq, vs = pool
    rq, rks, rvq, rvs = ref
    assert torch.equal(vq[new], rvq[new]) and torch.equal(vs[new], rvs[new])  # values: no RoPE, the same bits
    assert torch.equal(kq[new[0]], rq[new[0]]) and torch.equal(ks[new[0]], rks[new[0]])  # position 0: exact RoPE
    # elsewhere C's RoPE may differ from PyTorch's in the last bit of a rotated element (a fused
    # multiply-add): the relative ulp u is 2^-23 in float32, up to 2^-7 in bfloat16. The scale
    # then moves by u at most, and x / scale by 127 u for the element plus 127 u for the scale:
    # under 1 in float32 (a code off by one at a tie), under 2 in bfloat16
    u = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    assert ((kq[new].int() - rq[new].int()).abs() <= (1 if dtype == torch.float32 else 2)).all()
    assert ((ks[new] - rks[new]).abs() <= u * rks[new]).all()
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[new] = False
    assert all(torch.equal(a[untouched], b[untouched]) for a, b in zip(pool, ref, strict=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_row_over_an_int8_pool_attended_in_parts_equals_the_dequantised_pool(threads):
    """From 512 positions a row is attended in two halves merged by their log-sum-exp (fused.c,
    merge_parts): here whole, then in halves of 701 and 1,101, int8 keys and values scaled per
    position. float32 only:
    in bfloat16 these peaked softmaxes over 1,100 positions miss the short rows' tolerance with the
    row attended whole as well."""
    heads, kv_heads, dim, dtype = 9, 3, 64, torch.float32
    lengths = torch.tensor([300, 700, 1100])
    rows, cap = 3, 1101
    slots = rows * cap + 1  # slot 0 (scratch) unused
    cos, sin = rope_tables(dim, 10000.0, None, cap, dtype, CPU)
    qkv = (3 * torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(25))).to(dtype)
    table = (torch.randperm(slots - 1, generator=_g(26)) + 1).view(rows, cap).clone()
    pool = _pool(slots, kv_heads, dim, 27)
    ref = tuple(t.clone() for t in pool)
    expected = _reference(qkv, cos, sin, lengths, table, ref, heads, None, dtype)
    got = _attend(qkv, cos, sin, lengths, table, pool, heads, None, threads, dtype)
    assert (got.float() - expected).abs().max().item() <= TOL[dtype] * max(1.0, expected.abs().max().item())


@DTYPES
def test_the_kernel_rounds_half_to_even_and_gives_a_zero_vector_scale_zero(dtype):
    """Keys at position 0 (RoPE is the identity there) whose largest element is 127: the scale
    is 1 and the codes are the elements rounded, ties to even, as torch.round does."""
    heads, kv_heads, dim = 2, 2, 64
    ties = torch.tensor([127.0, -127.0, 63.5, 62.5, 0.5, 1.5, -2.5, -0.5, 126.5, -125.5])
    k = torch.cat([ties, torch.randint(-254, 255, (dim - len(ties),), generator=_g(1)) / 2])  # multiples of 1/2
    qkv = torch.zeros(1, (heads + 2 * kv_heads) * dim)
    parts = qkv.view(heads + 2 * kv_heads, dim)
    parts[:heads] = torch.randn(heads, dim, generator=_g(2))
    parts[heads] = k  # kv head 0's key; kv head 1's stays zero
    parts[heads + kv_heads] = k.flip(0)  # kv head 0's value; kv head 1's stays zero
    qkv = qkv.to(dtype)
    cos, sin = rope_tables(dim, 10000.0, None, 8, dtype, CPU)
    pool = tuple(t.zero_() for t in _pool(4, kv_heads, dim, 0))
    table = torch.tensor([[3, 0]])
    out = _attend(qkv, cos, sin, torch.tensor([0]), table, pool, heads, None, 1, dtype)
    kq, ks, vq, vs = pool
    assert ks[3].tolist() == [1.0, 0.0] and vs[3].tolist() == [1.0, 0.0]
    assert kq[3, 0].tolist() == torch.round(k).to(torch.int8).tolist() == quantize(k)[0].tolist()
    assert kq[3, 0, :8].tolist() == [127, -127, 64, 62, 0, 2, -2, 0]
    assert vq[3, 0].tolist() == torch.round(k.flip(0)).to(torch.int8).tolist()
    assert not kq[3, 1].any() and not vq[3, 1].any()
    assert torch.isfinite(out.float()).all() and not out[0, dim:].any()  # head 1 attends a zero value: 0, not NaN


@DTYPES
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_prefix_attention_reads_an_int8_pool_as_the_per_row_path_does(threads, dtype):
    heads, kv_heads, dim, rows, cap, slots = 6, 2, 64, 9, 120, 1200
    lengths = torch.tensor([90, 95, 100, 81, 85, 110, 70, 75, 30])
    free = torch.randperm(slots - 1, generator=_g(3)) + 1
    table = torch.zeros(rows, cap, dtype=torch.long)
    table[:8, :70] = free[:70]  # a prompt shared by rows 0..7
    table[:3, 70:80] = free[70:80]  # nested: a continuation shared by rows 0..2
    at = 80
    for r in range(rows):
        start = 80 if r < 3 else 70 if r < 8 else 0
        n = int(lengths[r]) + 1 - start
        table[r, start:start + n] = free[at:at + n]
        at += n
    sharing = find_sharing(table.numpy(), lengths.numpy())
    assert sharing is not None and sharing.spans == 2
    cos, sin = rope_tables(dim, 10000.0, None, 128, dtype, CPU)
    qkv = (2 * torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(4))).to(dtype)
    pools = [_pool(slots, kv_heads, dim, 9) for _ in range(2)]
    per_row = _attend(qkv, cos, sin, lengths, table, pools[0], heads, None, threads, dtype)
    shared = _attend(qkv, cos, sin, lengths, table, pools[1], heads, None, threads, dtype, sharing)
    assert all(torch.equal(a, b) for a, b in zip(*pools, strict=True))  # the same codes and scales written
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}[dtype]  # summation order; one bfloat16 rounding
    assert (per_row.float() - shared.float()).abs().max().item() <= tol * max(1.0, per_row.abs().max().item())


@DTYPES
@pytest.mark.parametrize("kind", ["llama", "qwen2-bias", "mistral-window"])
def test_fused_int8_steps_equal_pytorch_int8_steps_for_mixed_length_rows(kind, dtype):
    extra = {"qwen2-bias": {"model_type": "qwen2"},
             "mistral-window": {"model_type": "mistral", "sliding_window": 6}}.get(kind, {})
    model_type = extra.pop("model_type", "llama")
    plain = _as(_tiny(model_type, **extra), dtype).with_options(INT8)
    counting = _Counting(KERNELS)
    fused = LlamaModel(plain.config, plain.embed, plain.layers, plain.norm, plain.lm_head, counting, INT8)
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.15}[dtype]  # as tests/test_fused.py: float rounding
    prompts = torch.randint(0, 103, (2, 9), generator=_g(8))
    valid = torch.tensor([9, 4])
    caches = [m.new_cache(2, 40) for m in (plain, fused)]
    assert caches[1].pool.dtype == torch.int8
    outs = [m.forward(prompts, c, valid=valid, last_only=True) for m, c in zip((plain, fused), caches, strict=True)]
    for _ in range(14):  # past the sliding window
        token = outs[0][:, -1].argmax(-1, keepdim=True)
        before = counting.calls
        outs = [m.forward(token, c) for m, c in zip((plain, fused), caches, strict=True)]
        assert counting.calls > before  # the fused kernels took the step
        assert (outs[0].float() - outs[1].float()).abs().max().item() <= tol * max(1.0, outs[0].abs().max().item())
    # layer 0's keys and values come from the same tokens through the same matmul on both paths:
    # the kernels wrote the PyTorch path's codes, up to their RoPE's last bit (as bounded above)
    a, b = (c.pool for c in caches)
    kept, kept_fused = (torch.from_numpy(c.slots[:, :18].reshape(-1)) for c in caches)  # both rows' own positions
    off = 1 if dtype == torch.float32 else 2
    assert ((a.keys[0][kept].int() - b.keys[0][kept_fused].int()).abs() <= off).all()
    assert torch.equal(a.values[0][kept], b.values[0][kept_fused])


@DTYPES
def test_fused_int8_steps_with_shared_prefix_attention_equal_the_pytorch_path(dtype):
    plain = _as(_tiny(), dtype).with_options(INT8)
    on = plain.with_fused(KERNELS).with_options(EngineOptions(kv_dtype="int8", shared_prefix_attention="on"))
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.15}[dtype]
    prompt = torch.randint(0, 103, (1, 20), generator=_g(4))
    caches = []
    for model in (plain, on):
        root = model.new_cache(1, 60)
        model.forward(prompt, root)
        caches.append(root.fork([0] * 5))
        root.release()
    tokens = torch.tensor([[3], [50], [77], [9], [1]])
    for _ in range(8):
        assert on._sharing(caches[1]) is not None
        outs = [m.forward(tokens, c) for m, c in zip((plain, on), caches, strict=True)]
        assert (outs[0].float() - outs[1].float()).abs().max().item() <= tol * max(1.0, outs[0].abs().max().item())
        tokens = outs[0][:, -1].argmax(-1, keepdim=True)


def test_one_call_over_an_int8_pool_equals_the_python_loop_bit_for_bit(monkeypatch):
    """Quantised (Q8_0) weights take every layer in one `decode_layers` call: over an int8 pool it
    gives the Python loop's bits (the same kernels in the same order) and the PyTorch path's
    logits to float rounding."""
    if quant.kernels().kernels is None:
        pytest.skip("no quantised kernels here")
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 101, "hidden_size": 128, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    sd = random_weights(cfg, seed=0)
    blocks = {k: quant.quantize(v, "Q8_0") for k, v in sd.items() if k.endswith("proj.weight")}
    plain = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32, blocks=blocks).with_options(INT8)
    model = plain.with_fused(KERNELS)
    assert model._plan(3) is not None

    def run(m, python_loop):
        with monkeypatch.context() as patch:
            if python_loop:
                patch.setattr(m, "_plan", lambda rows: None)
            cache = m.new_cache(3, 64)
            ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1], [5, 5, 5, 5]])
            logits = m.forward(ids, cache, valid=torch.tensor([4, 2, 3]), last_only=True)
            out = [logits]
            for step in range(5):  # the same tokens on every path: the logits compare like for like
                out.append(m.forward(torch.tensor([[7 + step], [30 + step], [60 + step]]), cache))
            return torch.stack(out)

    one_call, loop, pytorch = run(model, False), run(model, True), run(plain, False)
    assert torch.equal(one_call, loop)
    assert (one_call - pytorch).abs().max().item() <= 1e-4 * max(1.0, pytorch.abs().max().item())
