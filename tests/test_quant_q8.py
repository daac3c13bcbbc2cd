"""q8 activations (quant_q8.h, `QuantWeight.with_activations("q8")`): the inputs' int8
quantisation against its PyTorch statement bit for bit, and every quantised type's integer
matmul, in both layouts, against the float64 product of the dequantised weight and the
dequantised inputs.

Error bound (`_q8_excess`): the integer sums are exact, so the only rounding is the float
epilogue: per (sub-)block scale dx (one rounding), its fma into the accumulator (one), the offset
term c dx S (two) and its fma (one), the accumulator's sums over the blocks (GGUF's layout: 8 lanes
then 3 levels of pairwise sums and the offsets' scalar chain): |y - y_exact| <= (4 blocks + 8) u
sum_i (|scale q_i| + |c off|) |x^_i| to first order, x^ the dequantised inputs, blocks the
number of 16-element halves; twice that without fma (generic x86).

Every test runs once per instruction-set path this CPU runs (the ``kernel_path`` fixture)."""

from dataclasses import replace

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import isa, quant, quant_library
from metaloom.models.kernels.quant import QuantWeight
from metaloom.models.kernels.quant_library import kernels
from metaloom.models.kernels.quant_torch import q8_inputs_torch
from metaloom.models.kernels.quant_types import QTYPES
from tests.test_quant_kernels import U, random_blocks, reference
from tests.test_quant_panels import offsets

KERNELS = kernels().kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no quant kernels here: {kernels().reason}")
KERNELS_OF = kernels  # the library under test, for the path_kernels fixture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("path_kernels")
Q8 = sorted(quant.Q8_TYPES)
PANELS = sorted(quant.PANEL_TYPES)
TYPES = pytest.mark.parametrize("qtype", Q8, ids=[QTYPES[t].name for t in Q8])


def _inputs(qtype: int) -> int:
    return 512 if QTYPES[qtype].block == 256 else 96


def dequantised_inputs(x: torch.Tensor) -> torch.Tensor:
    """x as the q8 kernels see it: q d, in float64."""
    q, d = q8_inputs_torch(x)
    return (q.double().unflatten(-1, (-1, 32)) * d.double().unsqueeze(-1)).flatten(-2)


def _q8_excess(y: torch.Tensor, x: torch.Tensor, qtype: int, blocks, factor: int) -> float:
    """max over outputs of |y - x^ W^T| / (bound u sum (|scale q| + |c off|) |x^|): <= 1 passes."""
    w = torch.from_numpy(reference(qtype, blocks)).double()
    c = torch.from_numpy(offsets(qtype, blocks))
    xd = dequantised_inputs(x)
    exact = xd @ w.T
    scale = xd.abs() @ ((w - c).abs() + c.abs()).T
    bound = (4 * (w.shape[1] // 16) + 8) * factor
    return ((y.double() - exact).abs() / (bound * U * scale + 1e-300)).max().item()


def _factor() -> int:
    return 1 if isa.has_fma(isa.chosen().name) else 2


@needs
def test_the_inputs_are_quantised_as_the_pytorch_statement_says():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 256, generator=g) * torch.logspace(-6, 4, 7).unsqueeze(1)
    x[0, :32] = 0.0  # an all-zero block: d 0, q 0
    x[1, :32] = torch.arange(-16, 16) * 0.5  # ties at .5 multiples of d
    x[2, 32:64] = torch.tensor([127.0, -63.5, 62.5, 0.5] * 8)  # d = 1: exact ties, both signs
    x[3, 64:96] = float("inf")
    x[3, 100] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        q, d, s = KERNELS.q8_inputs(xs)
        tq, td = q8_inputs_torch(xs)
        assert torch.equal(q, tq)
        assert torch.equal(d.isnan(), td.isnan()) and torch.equal(d[~d.isnan()], td[~td.isnan()])
        assert d[3, 2].isnan() and d[3, 3].isnan() and not d[3, 1].isnan()  # only the blocks holding them
        assert torch.equal(s[:, :8], q.view(7, 8, 32).int().sum(-1))  # per 32
        assert torch.equal(s[:, 8:], q.view(7, 16, 16).int().sum(-1))  # per 16
    assert q8_inputs_torch(x[2:3])[0][0, 32:36].tolist() == [127, -64, 63, 1]  # half away from zero
    xf = xs.float().view(7, 8, 32)[4:]  # |x - q d| <= d / 2, but for the rounding of x (1 / d)
    err = (tq.float().view(7, 8, 32)[4:] * td[4:].unsqueeze(-1) - xf).abs()
    assert (err <= td[4:].unsqueeze(-1) / 2 + xf.abs() * 2**-22).all()


def _call(w: QuantWeight, x: torch.Tensor, threads: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.out_features, dtype=out_dtype or x.dtype)
    KERNELS.matmul_q8(w.qtype, w.blocks, w.in_features, x.contiguous(), y, x.shape[0], threads, w.layout)
    return y


@needs
@TYPES
@pytest.mark.parametrize("layout", ["gguf", "panel"])
def test_q8_matmul_is_the_product_of_the_dequantised_weight_and_inputs(qtype, layout):
    if layout == "panel" and qtype not in quant.PANEL_TYPES | {quant.Q8_0}:
        pytest.skip(f"{QTYPES[qtype].name} has no panel layout")
    inputs = _inputs(qtype)
    blocks = random_blocks(qtype, 48, inputs, seed=2)
    w = QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs).with_activations("q8")
    w = w.panelled() if layout == "panel" else w
    assert w.layout == layout
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(3))
    x[0, 5] = 3e3  # an outlier input, as real activations have
    alone = torch.cat([_call(w, x[i:i + 1], 1) for i in range(40)])
    for rows in (1, 2, 5, 7, 9, 17, 40):
        for threads in (1, 2):
            y = _call(w, x[:rows], threads)
            assert _q8_excess(y, x[:rows], qtype, blocks, _factor()) <= 1, (rows, threads)
            assert torch.equal(y, alone[:rows])  # a row's result: alone, in any batch, on any thread count
    xb = x[:5].bfloat16()  # bfloat16 in and out: the same sums of the same (exactly converted) inputs, rounded once
    assert torch.equal(_call(w, xb, 2), _call(w, xb.float(), 2).bfloat16())


@needs
@pytest.mark.parametrize("qtype", PANELS, ids=[QTYPES[t].name for t in PANELS])
def test_a_q8_weight_calls_its_kernel_for_any_rows_in_either_layout(qtype, monkeypatch):
    inputs = _inputs(qtype)
    blocks = random_blocks(qtype, 32, inputs, seed=4)
    w = QuantWeight(qtype, torch.from_numpy(blocks.copy()), inputs).with_activations("q8")
    p = w.panelled()
    assert p.activations == "q8" and p.layout == "panel" and p.gguf().activations == "q8"
    x = torch.randn(quant.PANEL_CROSSOVER_ROWS + 3, inputs, generator=torch.Generator().manual_seed(5))
    for weight in (w, p):  # past every crossover: still the integer kernel, each row as alone
        y = weight(x.view(-1, 1, inputs))
        assert y.shape == (x.shape[0], 1, 32)
        n = x.shape[0]
        assert torch.equal(y[-2:, 0], torch.cat([weight(x[i:i + 1]) for i in (n - 2, n - 1)]))
        assert _q8_excess(y[:, 0], x, qtype, blocks, _factor()) <= 1
    monkeypatch.setattr(quant, "kernels", lambda: quant_library.Availability(None, "forced off"))
    y = w(x[:3])  # without kernels: the same quantised inputs times the dequantised weight, in float32
    assert _q8_excess(y, x[:3], qtype, blocks, _factor() * 8) <= 1


@needs
def test_q8_0_panels_sum_each_blocks_exact_integers_then_one_fma_chain():
    """quant_q8_0.h's arithmetic, bit for bit on every path: per (row, output) the exact int32 sum
    of each block's 32 quant products, then acc = fma(float(isum), d dx, acc) over the blocks in
    order. Weights reach both ends of int8 (-128 goes into vpdpbusd as 0, and its magnitude 128
    against |x| <= 127 into vpmaddubsw) and inputs reach +-127."""
    g = torch.Generator().manual_seed(6)
    out, inputs, rows = 48, 160, 21
    w = quant.quantize(torch.randn(out, inputs, generator=g), "Q8_0")
    b = w.blocks.view(out, inputs // 32, 34)
    b[:2, :, 2:] = torch.tensor([-128, 127], dtype=torch.int8).repeat(16).view(torch.uint8)  # the extremes
    b[2, 1, 2:] = torch.full((32,), -128, dtype=torch.int8).view(torch.uint8)
    p = w.with_activations("q8").panelled()
    assert p.layout == "panel" and torch.equal(p.gguf().blocks, w.blocks)
    assert torch.equal(quant.unpanel_numpy(p.qtype, p.blocks, inputs), w.blocks)  # the numpy inverse agrees
    assert w.panelled() is w  # float activations: Q8_0 has no float panel kernel
    assert p.with_activations("float").layout == "gguf" and torch.equal(p.with_activations("float").blocks, w.blocks)
    x = torch.randn(rows, inputs, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[0, :32] = torch.linspace(-1, 1, 32)  # inputs of +-127 (each block's largest)
    y = torch.empty(rows, out)
    KERNELS.matmul_q8(p.qtype, p.blocks, inputs, x, y, rows, 2, "panel")
    q, d, _ = KERNELS.q8_inputs(x)
    quants = b[:, :, 2:].contiguous().view(torch.int8).long()
    scales = b[:, :, :2].contiguous().view(torch.float16).float()[..., 0]
    isum = torch.einsum("obk,rbk->rbo", quants, q.long().view(rows, -1, 32))
    acc = torch.zeros(rows, out)
    for k in range(inputs // 32):
        s = scales[:, k][None, :] * d[:, k][:, None]  # d dx: one float32 product
        # fma(a, s, c): a s is exact in float64 (at most 20 + 24 bits); rounding a s + c to float64
        # and then to float32 is fma's one rounding unless the first lands on a float32 tie, which
        # these seeded values never do (a wrong order or a lost integer moves many outputs)
        if isa.has_fma(isa.chosen().name):
            acc = (isum[:, k].double() * s.double() + acc.double()).float()
        else:  # generic x86: a product, then a sum, each rounded
            acc = isum[:, k].float() * s + acc
    assert torch.equal(y, acc)


def test_activations_are_checked():
    w = QuantWeight(2, torch.from_numpy(random_blocks(2, 4, 64)), 64)
    with pytest.raises(InvalidParameter, match="activations"):
        w.with_activations("q4")
    bf16 = QuantWeight(30, torch.zeros(4, 32, dtype=torch.bfloat16).view(torch.uint8), 32)
    with pytest.raises(InvalidParameter, match=r"activations.*BF16"):
        bf16.with_activations("q8")
    with pytest.raises(InvalidParameter, match="activations mode"):
        QuantWeight.cat([w, w.with_activations("q8")])
    assert w.with_activations("float") is w and "q8" in repr(w.with_activations("q8"))


# ---- the model under q8 (metaloom.models.engine.native.with_activations, load(activations=...)) ----


def _toy_q8_model():
    """A 2-layer toy Llama on Q4_1 blocks (Q8_0 for v, so that q/k/v is a Concat of two types)
    with q8 activations and the fused kernels of the path under test."""
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.models.engine.llama import LlamaModel
    from metaloom.models.engine.native import with_activations
    from metaloom.models.kernels import fused
    from metaloom.testing.tiny import random_weights

    k = fused.kernels().kernels
    if k is None or KERNELS is None:
        pytest.skip("no kernels here")
    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 101, "hidden_size": 128, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    sd = random_weights(cfg, seed=0)
    blocks = {n: quant.quantize(w, "Q8_0" if "v_proj" in n else "Q4_1") for n, w in sd.items() if n.endswith("proj.weight")}
    model = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32, blocks=blocks).with_fused(k)
    return with_activations(model, "q8"), model


def test_a_q8_models_tree_verify_gives_each_node_a_one_token_steps_bits():
    """Speculation stays exact under q8: a verify runs each drafted token through the one-token
    kernels as a row of its own, and each row's int8 inputs depend on that row alone."""
    from metaloom.speculative.tree import DraftTree, attention_mask

    model, float_model = _toy_q8_model()
    assert all(p.activations == "q8" for p in model.layers[0].qkv.parts) and model.layers[1].down.activations == "q8"
    assert float_model.layers[0].down.activations == "float"
    assert model._plan(7) is not None  # the one-call stack, with quant_q8.h's kernels in its descriptors
    tree = DraftTree(tokens=(10, 11, 12, 13, 14, 15), parents=(-1, -1, 0, 1, 2, 1))
    cache = model.new_cache(1, 96)
    model.forward(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]), cache)
    _, hidden = model.forward_hidden(torch.tensor([[7, *tree.tokens]]), cache.fork([0]), tree=attention_mask(tree)[None])
    for leaf in (4, 3, 5):
        chain = cache.fork([0])
        for token, node in zip([7, *(tree.tokens[i] for i in tree.path(leaf))], [-1, *tree.path(leaf)], strict=True):
            assert torch.equal(model.forward_hidden(torch.tensor([[token]]), chain)[1][0, 0], hidden[0, node + 1])
        chain.release()
    # q8 changes the arithmetic, not the model: logits near the float activations' ones
    fc = float_model.new_cache(1, 96)
    a = model.forward(torch.tensor([[3, 1, 4, 1, 5]]), model.new_cache(1, 96))
    b = float_model.forward(torch.tensor([[3, 1, 4, 1, 5]]), fc)
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@needs
def test_a_tied_q8_0_head_takes_q8_in_its_panels_which_also_serve_the_embedding(monkeypatch):
    """Under q8 a Q8_0 head multiplies int8 inputs in quant_q8_0.h's panels; a tied embedding
    looks its rows up in the same panels (one table held, not two), exactly as from the file's blocks."""
    from metaloom.models.engine.config import LlamaConfig
    from metaloom.models.engine.llama import LlamaModel
    from metaloom.models.engine.native import with_activations
    from metaloom.testing.tiny import random_weights

    cfg = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 112, "hidden_size": 128, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True})
    sd = random_weights(cfg, seed=1)
    blocks = {n: quant.quantize(w, "Q8_0" if "embed" in n else "Q4_1") for n, w in sd.items()
              if n.endswith("proj.weight") or "embed_tokens" in n}
    model = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32, blocks=blocks)
    assert model.lm_head is model.embed and model.lm_head.layout == "gguf"
    q8 = with_activations(model, "q8")
    assert q8.lm_head.layout == "panel" and q8.lm_head.activations == "q8" and q8.embed is q8.lm_head
    assert q8.num_parameters() == model.num_parameters()
    ids = torch.tensor([[0, 15, 16], [111, 7, 7]])
    assert torch.equal(q8.embed.rows(ids), model.embed.rows(ids))
    assert torch.equal(q8.embed.rows(ids, torch.bfloat16), model.embed.rows(ids, torch.bfloat16))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    a = q8.forward(prompt, q8.new_cache(1, 96))
    b = model.forward(prompt, model.new_cache(1, 96))
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # the same model, another arithmetic
    monkeypatch.setattr(quant, "kernels", lambda: quant_library.Availability(None, "forced off"))
    assert torch.equal(q8.embed.rows(ids), model.embed.rows(ids))  # PyTorch's reading of the panels agrees


def test_q8_needs_native_quantised_weights():
    from metaloom.models.engine.native import with_activations

    model, _ = _toy_q8_model()
    dense = type(model)(model.config, model.embed, [replace(model.layers[0], o=model.layers[0].o.dequantize()),
                                                    *model.layers[1:]], model.norm, model.lm_head)
    with pytest.raises(InvalidParameter, match=r"activations.*layer 0's o is dense torch.float32"):
        with_activations(dense, "q8")
    with pytest.raises(InvalidParameter, match="activations"):
        with_activations(model, "int4")
    assert with_activations(model, "float") is model


def test_load_refuses_q8_where_it_cannot_run_naming_the_flag(monkeypatch):
    import importlib

    from metaloom.models.load import load

    load_module = importlib.import_module("metaloom.models.load")

    for kwargs, why in (({"weights": "dense"}, "weights=dense"), ({"backend": "transformers"}, "transformers backend"),
                        ({"activations": "int4"}, "one of")):
        with pytest.raises(InvalidParameter, match=rf"activations.*{why}"):
            load("default", **{"activations": "q8", **kwargs})
    monkeypatch.setattr(load_module, "pick_device", lambda device: torch.device("cuda"))  # a GPU, on any machine
    with pytest.raises(InvalidParameter, match=r"activations.*CPU kernels, not cuda"):
        load("default", activations="q8")


def test_the_default_model_under_q8_greedy_is_the_same_with_and_without_speculation():
    """On the default model's own blocks with q8 activations: prompt lookup and a Token Recycling
    tree emit plain greedy's tokens and log-probabilities exactly."""
    from metaloom.generator import LocalGenerator, Request
    from metaloom.generator.types import TokenIds
    from metaloom.ledger import Ledger
    from metaloom.models.load import load
    from metaloom.sampling import SamplingParams
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.ngram import NgramDrafter
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    loaded = load("default", activations="q8")
    assert (loaded.weights, loaded.activations) == ("native", "q8")
    if loaded.model._plan(16) is None:
        pytest.skip("no fused kernels here")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = TokenIds(tuple(loaded.tokenizer.encode("red green blue red green blue red green blue red green blue red")))
    plain = LocalGenerator(loaded).generate([Request(prompt, params)], ledger=Ledger())[0][0]
    for drafter in (NgramDrafter(), RecyclingDrafter(TreeShape.parse("static:4,2,1"))):
        ledger = Ledger()
        got = LocalGenerator(loaded, speculative=Speculative(drafter, 8)).generate([Request(prompt, params)],
                                                                                     ledger=ledger)[0][0]
        assert got.token_ids == plain.token_ids and got.logprobs == plain.logprobs, type(drafter).__name__
        assert ledger.usage.accepted_tokens > 5  # drafts were verified and kept: multi-row forwards ran


def test_auto_activations_pick_q8_where_it_runs_and_float_elsewhere(monkeypatch):
    """``activations="auto"`` (`metaloom serve`'s default): q8 on a GGUF's own blocks on the CPU,
    float where q8 cannot run, and the result says which; q8 asked for outright still refuses."""
    import importlib

    from metaloom.cli import build_parser
    from metaloom.models.load import load

    loaded = load("default", activations="auto")
    assert (loaded.weights, loaded.activations) == ("native", "q8")
    assert loaded.model.layers[0].down.activations == "q8"
    dense = load("default", activations="auto", weights="dense")
    assert (dense.weights, dense.activations) == ("dense", "float")
    # a layer weight q8 does not multiply (an F16 one, say): auto keeps float on the same native weights
    native = importlib.import_module("metaloom.models.engine.native")

    def refuse(model, activations):
        raise InvalidParameter("activations", activations, "float here: layer 0's o is F16")

    monkeypatch.setattr(native, "with_activations", refuse)
    fallback = load("default", activations="auto")
    assert (fallback.weights, fallback.activations) == ("native", "float")
    assert fallback.model.layers[0].down.activations == "float"
    with pytest.raises(InvalidParameter, match="layer 0's o is F16"):
        load("default", activations="q8")
    # the server defaults to auto; the other commands keep float
    parser = build_parser()
    assert parser.parse_args(["serve"]).activations == "auto"
    assert parser.parse_args(["generate", "hi"]).activations == "float"
