"""Packed CPU weights (metaloom.models.kernels.packed): the same products as the plain kernels, for any
row count, and a packed model that decodes like the plain one; bfloat16 packed only where oneDNN
has bfloat16 kernels for the CPU, metaloom's own bfloat16 kernel (`Bf16Linear`) elsewhere. Every
test runs once per instruction-set path this CPU runs (``kernel_path``: a path forced below
avx512 stands for a CPU without oneDNN's bfloat16)."""

import pytest
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel, dense_weight, plain_weight
from metaloom.models.kernels import isa
from metaloom.models.kernels.onednn import bf16_gemm
from metaloom.models.kernels.packed import Bf16Linear, PackedLinear, own_bf16, pack, packing_available
from metaloom.testing.tiny import random_weights

CPU = torch.device("cpu")
needs = pytest.mark.skipif(not packing_available(torch.float32, CPU), reason="this torch build has no MKL/oneDNN")
pytestmark = pytest.mark.usefixtures("kernel_path")


@needs
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 2, 11, 40])
def test_packed_product_equals_plain(dtype, tol, rows):
    if not packing_available(dtype, CPU):
        assert dtype == torch.bfloat16 and not bf16_gemm()
        pytest.skip("oneDNN has no bfloat16 kernels for this CPU (or path): metaloom's own run instead")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(3, rows, 64, generator=g).to(dtype)[:1]  # a [1, rows, 64] view of a bigger tensor
    p = pack(w)
    y = p(x)
    assert y.shape == (1, rows, 96) and y.dtype == dtype
    ref = F.linear(x.float(), w.float())
    assert (y.float() - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert p.numel() == w.numel()
    assert (p.one_row is not None) == (dtype == torch.float32)  # MKL's packed GEMM is float32 only


def _tiny_model() -> LlamaModel:
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    return LlamaModel.from_state_dict(cfg, random_weights(cfg, seed=0))


@needs
def test_packed_model_matches_plain_prefill_decode_and_verify():
    plain = _tiny_model()
    packed = plain.packed()
    assert isinstance(packed.layers[0].qkv, PackedLinear) and isinstance(packed.lm_head, PackedLinear)
    assert packed.num_parameters() == plain.num_parameters()  # the tied head is not counted twice
    assert dense_weight(packed.lm_head) is plain.embed
    caches = [m.new_cache(2, 64) for m in (plain, packed)]
    prompt = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    outs = [m.forward(prompt, c) for m, c in zip((plain, packed), caches, strict=True)]
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
    for step in range(6):  # one-row decode in a batch of two (each row is one GEMM row)
        token = outs[0][:, -1].argmax(-1, keepdim=True)
        outs = [m.forward(token, c) for m, c in zip((plain, packed), caches, strict=True)]
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-4, step
    one = [m.new_cache(1, 64) for m in (plain, packed)]  # batch 1: the MKL one-row path
    a, b = (m.forward(prompt[:1, :1], c) for m, c in zip((plain, packed), one, strict=True))
    assert (a - b).abs().max().item() <= 1e-4
    draft = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(2))  # a k-row verify
    a, b = (m.forward(draft, c) for m, c in zip((plain, packed), one, strict=True))
    assert (a - b).abs().max().item() <= 1e-4


def test_pack_refused_where_there_are_no_kernels():
    assert not packing_available(torch.float16, CPU)
    assert not packing_available(torch.float32, torch.device("meta"))


def test_load_pack_true_without_kernels_is_a_typed_error(smollm):
    from metaloom.models import load

    with pytest.raises(InvalidParameter, match="pack"):
        load("default", dtype="float16", pack=True)


@needs
def test_default_load_packs_on_the_cpu(smollm):
    assert isinstance(smollm.model.lm_head, PackedLinear)
    assert isinstance(smollm.model.layers[0].gate_up, PackedLinear)


def test_bfloat16_is_packed_only_where_onednn_has_it():
    """Checked, not assumed: on a path below avx512 (a CPU without AVX-512 BW/VL/DQ, unless it
    has AVX-NE-CONVERT) bfloat16 is not packed; where it is packable the reorder works."""
    expected = isa.chosen().name == "avx512" or "avx_ne_convert" in isa.cpu_features()
    if not expected:
        assert not bf16_gemm() and not packing_available(torch.bfloat16, CPU)
    if packing_available(torch.bfloat16, CPU):
        pack(torch.randn(32, 64).bfloat16())  # would raise where the CPU lacks the instructions


@pytest.mark.parametrize("rows", [1, 3, 40, 129, 300])
def test_own_bfloat16_product_is_the_float32_product_rounded_once(rows):
    """`Bf16Linear`: every bfloat16 weight and input widened exactly, float32 products and sums,
    one rounding of y to bfloat16: within float32 summation rounding of the float64 product,
    before that rounding (rows above the crossover: the same through PyTorch in float32 where
    oneDNN has no bfloat16 GEMM)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    lin = own_bf16(w)
    assert isinstance(lin, Bf16Linear) and lin.numel() == w.numel()
    assert lin.blocks.blocks.data_ptr() == w.data_ptr()  # the same storage, no copy
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 80)
    exact = x.double() @ w.double().T
    ulp = exact.abs().clamp_min(1e-30) * 2.0**-8  # one bfloat16 rounding: half an ulp, at most 2^-8 relative
    slack = 96 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)  # float32 summation
    assert ((y.double() - exact).abs() <= ulp + slack).all()
    yf = lin(x.float())  # float32 in and out: the float32 sums themselves
    assert ((yf.double() - exact).abs() <= slack).all()
    if rows <= 128 or not bf16_gemm():  # (above, with oneDNN's bfloat16: its own GEMM)
        assert torch.equal(y, yf.bfloat16())


def test_own_bfloat16_model_matches_the_plain_bfloat16_model():
    plain = _tiny_model()
    bf = LlamaModel.from_state_dict(plain.config, random_weights(plain.config, seed=0), dtype=torch.bfloat16)
    own = bf.own_bf16()
    assert isinstance(own.layers[0].gate_up, Bf16Linear) and isinstance(own.lm_head, Bf16Linear)
    assert plain_weight(own.lm_head) is bf.embed and own.num_parameters() == bf.num_parameters()
    prompt = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    caches = [m.new_cache(2, 32) for m in (bf, own)]
    a, b = (m.forward(prompt, c) for m, c in zip((bf, own), caches, strict=True))
    assert (a.float() - b.float()).abs().max().item() <= 3e-2 * a.float().abs().max().item()
    token = a[:, -1].argmax(-1, keepdim=True)
    a, b = (m.forward(token, c) for m, c in zip((bf, own), caches, strict=True))
    assert (a.float() - b.float()).abs().max().item() <= 3e-2 * a.float().abs().max().item()


def test_default_bfloat16_load_uses_the_fastest_bfloat16_products_here(smollm):
    from metaloom.models import load

    m = load("default", dtype="bfloat16", weights="dense").model
    kind = PackedLinear if packing_available(torch.bfloat16, CPU) else Bf16Linear
    assert isinstance(m.layers[0].gate_up, kind) and isinstance(m.lm_head, kind)
    ids = smollm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    logits = m.forward(torch.tensor([ids]), m.new_cache(1, 16))[0, -1].float()
    ref = smollm.model.forward(torch.tensor([ids]), smollm.model.new_cache(1, 16))[0, -1]
    assert logits.argmax() == ref.argmax()
    assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()
