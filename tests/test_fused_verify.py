"""A speculative verify through the fused one-token kernels (`LlamaModel._verify_fused`): each
drafted token a row of its own, attending its row's cache and the ancestors written in the
same call (fused.c's ``write_new``).

- On quantised weights (the one-call stack) every node of a token tree gets, bit for bit, the
  hidden state a chain of one-token steps along its path gives: a greedy verify's argmaxes are
  plain greedy's, not only to rounding.
- Against the PyTorch ops (the eager path, what the model without kernels runs): rows of
  different lengths in one batch, padding, a finished row, chains and trees, an int8 KV pool,
  a sliding window (chains), shared-prefix attention forced on; the cache afterwards gives the
  same next step.
- Which blocks take the path: verifies of rows that hold keys, and prompts whose rows end within
  `fused_step.prefill_keys` keys, which then get the one-token steps' logits to the bit.

Every test runs once per instruction-set path this CPU runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from metaloom.models.engine import fused_step
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.kernels import fused, quant
from metaloom.speculative.tree import DraftTree, attention_mask
from metaloom.testing.tiny import random_weights

pytestmark = pytest.mark.usefixtures("kernel_path")

#   root -> 0 -> 2 -> 4
#        -> 1 -> 3
#             -> 5
TREE = DraftTree(tokens=(10, 11, 12, 13, 14, 15), parents=(-1, -1, 0, 1, 2, 1))
OTHER = DraftTree(tokens=(20, 21, 22), parents=(-1, 0, 0))  # a second row's tree, of three nodes


def _config(**extra) -> LlamaConfig:
    return LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 101, "hidden_size": 128, "intermediate_size": 256,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                **extra})


def _models(qtype: str | None = "Q4_1", **extra) -> tuple[LlamaModel, LlamaModel]:
    """(the model with the fused kernels of the path under test, the same model on the PyTorch
    ops); quantised linear weights (``qtype``) or dense float32 ones (None)."""
    k = fused.kernels().kernels
    if k is None or quant.kernels().kernels is None:
        pytest.skip("no kernels here")
    cfg = _config(**extra)
    sd = random_weights(cfg, seed=0)
    blocks = None if qtype is None else {n: quant.quantize(w, qtype) for n, w in sd.items() if n.endswith("proj.weight")}
    model = LlamaModel.from_state_dict(cfg, sd, dtype=torch.float32, blocks=blocks)
    return model.with_fused(k), model


def _prefilled(model: LlamaModel, prompts: list[list[int]], capacity: int = 96):
    cache = model.new_cache(len(prompts), capacity)
    for b, ids in enumerate(prompts):  # rows of different lengths: one row's prefill at a time
        valid = torch.tensor([len(ids) if r == b else 0 for r in range(len(prompts))])
        width = max(len(p) for p in prompts)
        block = torch.tensor([(p if r == b else []) + [0] * (width - (len(p) if r == b else 0))
                              for r, p in enumerate(prompts)])
        model.forward(block, cache, valid=valid)
    return cache


def test_every_tree_node_gets_a_one_token_steps_bits_on_quantised_weights():
    model, _ = _models("Q4_1")
    assert model._plan(7) is not None  # the one-call stack: the quantised kernels keep rows apart
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = _prefilled(model, [prompt])
    tokens = torch.tensor([[7, *TREE.tokens]])
    mask = attention_mask(TREE)[None]
    assert model._verify_applies(cache, tokens.shape[1], mask)
    _, hidden = model.forward_hidden(tokens, cache.fork([0]), tree=mask)
    for leaf in (4, 3, 5):
        chain = cache.fork([0])
        steps = [7, *(TREE.tokens[i] for i in TREE.path(leaf))]
        nodes = [-1, *TREE.path(leaf)]
        for token, node in zip(steps, nodes, strict=True):
            _, one = model.forward_hidden(torch.tensor([[token]]), chain)
            assert torch.equal(one[0, 0], hidden[0, node + 1]), (leaf, node)
        chain.release()
    # and a chain verify: each token as the one-token steps before it left the cache
    _, chained = model.forward_hidden(torch.tensor([[7, 10, 12, 14]]), cache.fork([0]))
    stepper = cache.fork([0])
    for at, token in enumerate([7, 10, 12, 14]):
        assert torch.equal(model.forward_hidden(torch.tensor([[token]]), stepper)[1][0, 0], chained[0, at])


def _compare(fast: LlamaModel, slow: LlamaModel, prompts, blocks, valid, masks, atol=1e-4):
    """One verify forward on each model from the same prefilled rows, then one more step from
    what each verify left: logits (of magnitude ~10) agree to float rounding."""
    caches = [_prefilled(m, prompts) for m in (fast, slow)]
    tokens, valid = torch.tensor(blocks), torch.tensor(valid)
    outs = [m.forward(tokens, c, valid=valid, tree=masks) for m, c in zip((fast, slow), caches, strict=True)]
    for b, v in enumerate(valid.tolist()):
        if v:
            assert (outs[0][b, :v] - outs[1][b, :v]).abs().max().item() < atol, b
        assert not outs[0][b, v:].any()  # padding: zeros, never read
    assert caches[0].host_lengths().tolist() == caches[1].host_lengths().tolist()
    nxt = torch.tensor([[5]] * len(prompts))
    after = [m.forward(nxt, c) for m, c in zip((fast, slow), caches, strict=True)]
    assert (after[0] - after[1]).abs().max().item() < atol


def _masks(width: int, trees: list[DraftTree | None]) -> torch.Tensor:
    """[B, width, width]: each row's tree mask, padded (a missing tree: the pending token alone)."""
    out = torch.zeros(len(trees), width, width, dtype=torch.bool)
    for b, tree in enumerate(trees):
        m = attention_mask(tree) if tree is not None else torch.ones(1, 1, dtype=torch.bool)
        out[b, :m.shape[0], :m.shape[0]] = m
        out[b].diagonal().fill_(True)
    return out


@pytest.mark.parametrize("qtype", ["Q4_1", None])
def test_rows_of_different_lengths_with_padding_and_a_finished_row_match_the_pytorch_ops(qtype):
    fast, slow = _models(qtype)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
    blocks = [[7, *TREE.tokens], [9, *OTHER.tokens, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0]]
    valid = [7, 4, 0]  # the third row finished: it keeps nothing
    _compare(fast, slow, prompts, blocks, valid, _masks(7, [TREE, OTHER, None]))
    _compare(fast, slow, prompts, [[7, 10, 12, 14, 0], [9, 20, 21, 0, 0], [4, 0, 0, 0, 0]], [4, 3, 0], None)


def test_an_int8_pool_and_forced_shared_prefix_attention_match_the_pytorch_ops():
    fast, slow = _models("Q4_1")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [8, 8, 8]]
    blocks, valid, masks = [[7, *TREE.tokens], [9, *OTHER.tokens, 0, 0, 0]], [7, 4], _masks(7, [TREE, OTHER])
    for options in ({"kv_dtype": "int8"}, {"shared_prefix_attention": "on"}):
        f, s = (m.with_options(replace(m.options, **options)) for m in (fast, slow))
        _compare(f, s, prompts, blocks, valid, masks, atol=3e-4)
        _compare(f, s, prompts, [[7, 10, 12, 14], [9, 20, 21, 0]], [4, 3], None, atol=3e-4)


def test_a_chain_under_a_sliding_window_matches_the_pytorch_ops():
    fast, slow = _models("Q4_1", model_type="mistral", sliding_window=6)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [8, 8, 8]]
    _compare(fast, slow, prompts, [[7, 10, 12, 14, 16], [9, 20, 21, 0, 0]], [5, 3], None)
    cache = _prefilled(fast, prompts)
    assert not fast._verify_applies(cache, 7, _masks(7, [TREE, OTHER]))  # a tree there: the eager path refuses it


def test_a_tree_of_the_pending_token_alone_is_the_one_token_step():
    """A step where nothing was drafted verifies a [B, 1, 1] tree: the one-token step's bits (it
    went to the PyTorch ops before, which differ in the last bits)."""
    fast, _ = _models("Q4_1")
    cache = _prefilled(fast, [[3, 1, 4, 1, 5], [9, 2, 6]])
    a = fast.forward(torch.tensor([[7], [8]]), cache.fork([0, 1]), tree=torch.ones(2, 1, 1, dtype=torch.bool))
    b = fast.forward(torch.tensor([[7], [8]]), cache.fork([0, 1]))
    assert torch.equal(a, b)


def test_which_blocks_take_the_fused_rows(monkeypatch):
    fast, _ = _models("Q4_1")
    monkeypatch.setattr(fused_step, "FUSED_PREFILL_KEYS", {})
    monkeypatch.setattr(fused_step, "FUSED_PREFILL_KEYS_ELSEWHERE", 40)
    fresh = fast.new_cache(1, 96)
    assert fast._verify_applies(fresh, 8, None) and fast._verify_applies(fresh, 40, None)  # a prompt within the keys
    assert not fast._verify_applies(fresh, 41, None)  # a longer one: PyTorch's blocked attention
    cache = _prefilled(fast, [[1, 2, 3]])
    assert fast._verify_applies(cache, 2, None) and fast._verify_applies(cache, 65, None)  # verifies, past the keys too
    assert fast._verify_applies(cache, 37, None) and not fast._verify_applies(cache, 66, None)  # a continuation
    assert not fast._verify_applies(cache, 1, None)  # one token: the one-token step itself
    int8 = fast.with_options(replace(fast.options, kv_dtype="int8"))
    assert not int8._verify_applies(int8.new_cache(1, 96), 8, None)  # an int8 pool's prompt: the PyTorch ops


def test_a_prompt_through_the_fused_rows_gets_one_token_steps_bits():
    """Rows of different lengths, padded, prefilled in one forward on quantised weights: every
    position's hidden state is, bit for bit, what feeding its row one token at a time gives (the
    logits too where the head keeps rows apart; this one is dense, a GEMM against one row's
    `mv`), and the logits agree with the PyTorch ops' blocked attention to float rounding."""
    fast, slow = _models("Q4_1")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 8, 8, 2]]
    block = torch.tensor([p + [0] * (11 - len(p)) for p in prompts])
    valid = torch.tensor([len(p) for p in prompts])
    cache = fast.new_cache(2, 32)
    assert fast._verify_applies(cache, 11, None)
    logits, hidden = fast.forward_hidden(block, cache, valid=valid)
    eager = slow.forward(block, slow.new_cache(2, 32), valid=valid)
    for b, ids in enumerate(prompts):
        stepper = fast.new_cache(1, 32)
        for i, token in enumerate(ids):
            assert torch.equal(fast.forward_hidden(torch.tensor([[token]]), stepper)[1][0, 0], hidden[b, i]), (b, i)
        assert (logits[b, :len(ids)] - eager[b, :len(ids)]).abs().max().item() < 1e-4
        assert not logits[b, len(ids):].any()  # padding: zeros, never read
    assert cache.host_lengths().tolist() == [11, 4]


@pytest.fixture(scope="module")
def native():
    from metaloom.models import load

    return {dtype: load("default", dtype=dtype, weights="native") for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_recycling_on_native_weights_gives_plain_greedys_log_probabilities_to_the_bit(native, dtype):
    """The default model on its own quantised weights: a Token Recycling tree's verify runs each
    token through the one-token kernels, so every emitted token's log-probability equals plain
    greedy's exactly (the PyTorch ops' verify agreed to rounding only), in both dtypes."""
    from dataclasses import replace as dc_replace

    from metaloom.generator import LocalGenerator, Request
    from metaloom.ledger import Ledger
    from metaloom.sampling import SamplingParams
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    k = fused.kernels().kernels
    if k is None or quant.kernels().kernels is None:
        pytest.skip("no kernels here")
    loaded = native[dtype]
    loaded = dc_replace(loaded, model=loaded.model.with_fused(k))
    assert loaded.model._plan(16) is not None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums."
    plain = LocalGenerator(loaded).generate([Request(prompt, params)], ledger=Ledger())[0][0]
    drafter = RecyclingDrafter(TreeShape.parse("static:4,2,1"))
    spec = LocalGenerator(loaded, speculative=Speculative(drafter, 12))
    ledger = Ledger()
    for _ in range(2):  # the second time round the matrix knows the text: more drafts kept
        got = spec.generate([Request(prompt, params)], ledger=ledger)[0][0]
        assert got.token_ids == plain.token_ids
        assert got.logprobs == plain.logprobs
    assert ledger.usage.accepted_tokens > 10 and ledger.usage.verify_steps < ledger.usage.output_tokens


def test_a_verify_under_auto_keeps_one_token_steps_bits_where_steps_would_share(monkeypatch):
    """Shared-prefix attention merges the drafted tokens' reads of the prompt in another order,
    so a verify takes it only when turned on: under ``auto``, even past its threshold, every
    drafted token gets a one-token step's bits (speculative greedy stays plain greedy)."""
    import metaloom.models.engine.fused_step as fused_step
    from metaloom.models.engine.options import EngineOptions

    model, _ = _models("Q4_1")
    monkeypatch.setattr(fused_step, "AUTO_SHARED_READS", 1)  # auto would share any shared key
    prompt = [(7 * i + 3) % 101 for i in range(40)]
    block = [7, 10, 12, 14, 16, 18]
    hidden = {}
    for mode in ("auto", "on"):
        m = model.with_options(EngineOptions(shared_prefix_attention=mode))
        cache = _prefilled(m, [prompt])
        hidden[mode] = m.forward_hidden(torch.tensor([block]), cache.fork([0]))[1][0]
    stepper = _prefilled(model, [prompt])
    steps = torch.stack([model.forward_hidden(torch.tensor([[t]]), stepper)[1][0, 0] for t in block])
    assert torch.equal(hidden["auto"], steps)
    assert not torch.equal(hidden["on"], steps)  # on: merged, equal to rounding only
    assert (hidden["on"] - steps).abs().max().item() < 1e-4
