"""The prefix cache's KV pool (budget, LRU, references) and generation through it: same tokens
as without it, with the shared prefix charged as cached and fewer FLOPs."""

import pytest
import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.cache import StaticKVCache
from metaloom.models.config import LlamaConfig
from metaloom.models.llama import LlamaModel
from metaloom.models.load import LoadedModel
from metaloom.prefix import PrefixCache
from metaloom.sampling import SamplingParams
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # bytes of one token's keys and values, float32


def _row(tokens, capacity=64, seed=None):
    """A one-row cache whose KV at position p is a function of the tokens up to p (like a
    real model's), so equal prefixes have equal blocks."""
    cache = StaticKVCache(LAYERS, 1, HEADS, capacity, DIM, torch.float32)
    for layer in range(LAYERS):
        for p in range(len(tokens)):
            g = torch.Generator().manual_seed(hash((tuple(tokens[:p + 1]), layer, seed)) % 2**31)
            cache.keys[layer][0, :, p] = torch.randn(HEADS, DIM, generator=g)
            cache.values[layer][0, :, p] = torch.randn(HEADS, DIM, generator=g)
    cache.advance(torch.tensor([len(tokens)]))
    return cache


def _loaded_back(pool, tokens):
    hit = pool.match(tokens)
    try:
        cache = StaticKVCache(LAYERS, 1, HEADS, 64, DIM, torch.float32)
        pool.load(hit, cache, 0)
        assert int(cache.lengths[0]) == hit.length
        return hit.length, cache
    finally:
        pool.release(hit)


def test_blocks_round_trip_and_bytes_are_counted_from_real_tensors():
    pool = PrefixCache(budget_bytes=10_000)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    assert pool.insert(a, _row(a), 0) == 6
    assert pool.insert(b, _row(b), 0) == 2  # splits the edge after (1, 2, 3)
    assert pool.bytes_per_token == PER_TOKEN
    held = sum(n.value.numel() * n.value.element_size() for n in pool.tree.nodes())
    assert pool.used_bytes == held == 8 * PER_TOKEN
    for tokens, expected in ((a, 6), (b, 5), ([1, 2, 3, 4, 7], 4)):
        n, cache = _loaded_back(pool, tokens)
        ref = _row(tokens)
        assert n == expected
        for layer in range(LAYERS):
            assert torch.equal(cache.keys[layer][0, :, :n], ref.keys[layer][0, :, :n])
            assert torch.equal(cache.values[layer][0, :, :n], ref.values[layer][0, :, :n])


@pytest.mark.parametrize("budget_tokens", [0, 3, 7, 12])
def test_budget_is_respected_after_every_insert(budget_tokens):
    pool = PrefixCache(budget_bytes=budget_tokens * PER_TOKEN + PER_TOKEN // 2)
    g = torch.Generator().manual_seed(budget_tokens)
    for _ in range(30):
        tokens = torch.randint(0, 3, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        pool.insert(tokens, _row(tokens), 0)
        assert pool.used_bytes <= pool.budget_bytes
        assert pool.cached_tokens <= budget_tokens


def test_least_recently_used_prefix_goes_first():
    pool = PrefixCache(budget_bytes=8 * PER_TOKEN)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    pool.insert(a, _row(a), 0)
    pool.insert(b, _row(b), 0)
    _loaded_back(pool, a)  # a is now more recent than b
    pool.insert(c, _row(c), 0)
    assert [_loaded_back(pool, t)[0] for t in (a, b, c)] == [4, 0, 4]


def test_a_referenced_prefix_is_never_evicted_and_release_frees_it():
    pool = PrefixCache(budget_bytes=6 * PER_TOKEN)
    a = [1, 1, 1, 1]
    pool.insert(a, _row(a), 0)
    hit = pool.match(a)  # in use
    other = [2, 2, 2, 2, 2, 2]
    assert pool.insert(other, _row(other), 0) == 2  # only the room left, a stays
    assert _loaded_back(pool, a)[0] == 4 and _loaded_back(pool, other)[0] == 2
    pool.release(hit)
    assert pool.insert(other, _row(other), 0) == 4  # now a, the older, makes room
    assert _loaded_back(pool, a)[0] == 0 and _loaded_back(pool, other)[0] == 6
    with pytest.raises(InvalidParameter):
        pool.release(hit)
    with pytest.raises(InvalidParameter):
        pool.insert([1] * 10, _row([1] * 3), 0)  # more tokens than the row holds


# --- generation --------------------------------------------------------------------------

def _tiny_llama(vocab=26):
    config = LlamaConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, 32, generator=g), "lm_head.weight": torch.randn(vocab, 32, generator=g),
          "model.norm.weight": torch.ones(32)}
    shapes = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (16, 32), "self_attn.v_proj": (16, 32),
              "self_attn.o_proj": (32, 32), "mlp.gate_proj": (64, 32), "mlp.up_proj": (64, 32), "mlp.down_proj": (32, 64)}
    for i in range(2):
        for name, shape in shapes.items():
            sd[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(32)
        sd[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(32)
    model = LlamaModel.from_state_dict(config, sd)
    return LoadedModel(model=model, tokenizer=CharTokenizer(vocab), name="tiny", folder="", dtype=torch.float32)


def _greedy(prompts, max_tokens=8):
    return [Request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]


def _ids(outs):
    return [[c.token_ids for c in out] for out in outs]


def test_tiny_model_cached_equals_uncached_for_a_batch_with_different_cached_lengths():
    loaded = _tiny_llama()
    plain = LocalGenerator(loaded)
    pool = PrefixCache(budget_bytes=1 << 20)
    cached = LocalGenerator(loaded, prefix_cache=pool)
    shared = "thequickbrownfoxjumpsoverthelazydog"
    first = _greedy([shared + "once", "abc"])
    assert _ids(cached.generate(first, ledger=Ledger())) == _ids(plain.generate(first, ledger=Ledger()))
    # rows now find 0, 3, len(shared)+2 and the whole prompt (all but its last token) cached
    second = _greedy(["zzzz", "abcd", shared + "ontheroad", shared + "once"])
    ledger, ref_ledger = Ledger(), Ledger()
    out = cached.generate(second, ledger=ledger)
    assert _ids(out) == _ids(plain.generate(second, ledger=ref_ledger))
    expected_cached = 0 + 3 + len(shared) + 2 + len(shared) + 3
    assert ledger.usage.cached_tokens == expected_cached
    assert ledger.usage.input_tokens == ref_ledger.usage.input_tokens
    assert ledger.usage.flops < ref_ledger.usage.flops
    # sampling with n > 1 forks rows that started from cached prefixes
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6)
    sample = [Request(shared + "once", params)]
    assert _ids(cached.generate(sample, ledger=Ledger())) == _ids(plain.generate(sample, ledger=Ledger()))


def test_prefix_cache_needs_a_block_cache_and_one_model():
    toy = LoadedModel(model=MarkovModel.random(5), tokenizer=CharTokenizer(5), name="toy", folder="", dtype=torch.float32)
    with pytest.raises(UnsupportedModel):
        LocalGenerator(toy, prefix_cache=PrefixCache(1 << 20))
    pool = PrefixCache(1 << 20)
    a, b = _tiny_llama(), _tiny_llama()
    LocalGenerator(a, prefix_cache=pool)
    LocalGenerator(a, prefix_cache=pool)  # the same model again is fine
    with pytest.raises(InvalidParameter):
        LocalGenerator(b, prefix_cache=pool)
    with pytest.raises(InvalidParameter):
        PrefixCache(-1)


@pytest.mark.model
def test_default_model_second_call_reuses_the_shared_prefix(smollm, smollm_generator):
    pool = PrefixCache(budget_bytes=256 << 20)
    cached = LocalGenerator(smollm, prefix_cache=pool)
    few_shot = "".join(f"Q: What is {i} plus {i + 1}?\nA: {2 * i + 1}.\n" for i in range(8))
    tok = smollm.tokenizer
    questions = ["Q: What is 20 plus 21?\nA:", "Q: What is 7 plus 30?\nA:"]
    first = _greedy([few_shot + questions[0]], 4)
    assert _ids(cached.generate(first, ledger=Ledger())) == _ids(smollm_generator.generate(first, ledger=Ledger()))
    second = _greedy([few_shot + q for q in questions], 6)
    ledger, ref_ledger = Ledger(), Ledger()
    assert _ids(cached.generate(second, ledger=ledger)) == _ids(smollm_generator.generate(second, ledger=ref_ledger))
    ids = [tok.encode(few_shot + q) for q in questions]
    common = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    # row 0 was stored whole by the first call (its last token is recomputed); row 1 shares
    # the few-shot block and whatever of the question matches
    assert common >= len(tok.encode(few_shot)) - 1
    assert ledger.usage.cached_tokens == len(ids[0]) - 1 + common
    assert ledger.usage.flops < 0.6 * ref_ledger.usage.flops
