"""Packed CPU weights (metaloom.models.packed): the same products as the plain kernels, for any
row count, and a packed model that decodes like the plain one."""

import pytest
import torch
import torch.nn.functional as F

from metaloom.errors import InvalidParameter
from metaloom.models.config import LlamaConfig
from metaloom.models.llama import LlamaModel, dense_weight
from metaloom.models.packed import PackedLinear, pack, packing_available

CPU = torch.device("cpu")
needs = pytest.mark.skipif(not packing_available(torch.float32, CPU), reason="this torch build has no MKL/oneDNN")


@needs
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 2, 11, 40])
def test_packed_product_equals_plain(dtype, tol, rows):
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
    torch.manual_seed(0)
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    sd = {"model.embed_tokens.weight": torch.randn(101, 64), "model.norm.weight": 1 + 0.1 * torch.randn(64)}
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64),
              "mlp.down_proj": (64, 96)}
    for i in range(2):
        for name, shape in shapes.items():
            sd[f"model.layers.{i}.{name}.weight"] = torch.randn(shape) / shape[1] ** 0.5
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(64)
    return LlamaModel.from_state_dict(cfg, sd)


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
