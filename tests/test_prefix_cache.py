"""The prefix cache over the engine's KV pool (budget, LRU, references, no copies) and
generation through it: same tokens as without it, with the shared prefix charged as cached and
fewer FLOPs; finished samples' tokens are kept, so a continuation prefills almost nothing."""

import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.pool import KVPool
from metaloom.models.load import LoadedModel
from metaloom.prefix import PrefixCache
from metaloom.sampling import SamplingParams
from metaloom.testing.tiny import tiny_llama
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

LAYERS, HEADS, DIM = 2, 2, 4
PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # bytes of one token's keys and values, float32


def _kv(tokens, p, layer):
    """The key of position p: a function of the tokens up to p (like a real model's)."""
    g = torch.Generator().manual_seed(hash((tuple(tokens[:p + 1]), layer)) % 2**31)
    return torch.randn(HEADS, DIM, generator=g)


def _row(pool, tokens):
    """A one-row cache in ``pool`` holding ``tokens``' (made-up) keys and values."""
    cache = PagedKVCache(pool, 1, 64)
    slots = cache.prepare([len(tokens)], len(tokens))
    for layer in range(LAYERS):
        k = torch.stack([_kv(tokens, p, layer) for p in range(len(tokens))])  # [T, H, D]
        cache.write(layer, k.transpose(0, 1)[None], -k.transpose(0, 1)[None], slots)
    cache.advance([len(tokens)])
    return cache


def _setup(budget_tokens):
    pool = KVPool(LAYERS, HEADS, DIM, torch.float32, slots=8)
    cache = PrefixCache(budget_bytes=budget_tokens * PER_TOKEN + PER_TOKEN // 2)
    cache.bind(pool)
    return pool, cache


def _loaded_back(prefix, tokens):
    hit = prefix.match(tokens)
    try:
        cache = PagedKVCache(prefix.pool, 1, 64)
        prefix.load(hit, cache, 0)
        assert int(cache.lengths[0]) == hit.length
        return hit.length, cache
    finally:
        prefix.release(hit)


def test_entries_are_slots_of_the_pool_not_copies():
    pool, prefix = _setup(100)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9]
    row_a, row_b = _row(pool, a), _row(pool, b)
    assert prefix.insert(a, row_a, 0) == 6
    assert prefix.insert(b, row_b, 0) == 2  # splits the edge after (1, 2, 3)
    assert prefix.bytes_per_token == PER_TOKEN == pool.bytes_per_slot
    assert prefix.used_bytes == 8 * PER_TOKEN and pool.used_slots == 11  # nothing copied: 6 + 5 slots
    row_a.release(), row_b.release()
    assert pool.used_slots == 8  # the tree keeps its 8 slots alive; b's shared (1, 2, 3) went back
    for tokens, expected in ((a, 6), (b, 5), ([1, 2, 3, 4, 7], 4)):
        n, cache = _loaded_back(prefix, tokens)
        assert n == expected
        assert pool.used_slots == 8  # loading hands slot ids over
        for layer in range(LAYERS):
            keys, values = cache.gather(layer, n)
            want = torch.stack([_kv(tokens, p, layer) for p in range(n)]).transpose(0, 1)
            assert torch.equal(keys[0], want) and torch.equal(values[0], -want)
        cache.release()


@pytest.mark.parametrize("budget_tokens", [0, 3, 7, 12])
def test_budget_is_respected_after_every_insert(budget_tokens):
    pool, prefix = _setup(budget_tokens)
    g = torch.Generator().manual_seed(budget_tokens)
    for _ in range(30):
        tokens = torch.randint(0, 3, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        row = _row(pool, tokens)
        prefix.insert(tokens, row, 0)
        row.release()
        assert prefix.used_bytes <= prefix.budget_bytes
        assert prefix.cached_tokens <= budget_tokens
        assert pool.used_slots == prefix.cached_tokens  # evicted entries gave their slots back


def test_least_recently_used_prefix_goes_first():
    pool, prefix = _setup(8)
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    for t in (a, b):
        prefix.insert(t, _row(pool, t), 0)
    _loaded_back(prefix, a)  # a is now more recent than b
    prefix.insert(c, _row(pool, c), 0)
    assert [_loaded_back(prefix, t)[0] for t in (a, b, c)] == [4, 0, 4]


def test_a_referenced_prefix_is_never_evicted_and_release_frees_it():
    pool, prefix = _setup(6)
    a = [1, 1, 1, 1]
    prefix.insert(a, _row(pool, a), 0)
    hit = prefix.match(a)  # in use
    other = [2, 2, 2, 2, 2, 2]
    assert prefix.insert(other, _row(pool, other), 0) == 2  # only the room left, a stays
    assert _loaded_back(prefix, a)[0] == 4 and _loaded_back(prefix, other)[0] == 2
    prefix.release(hit)
    assert prefix.insert(other, _row(pool, other), 0) == 4  # now a, the older, makes room
    assert _loaded_back(prefix, a)[0] == 0 and _loaded_back(prefix, other)[0] == 6
    with pytest.raises(InvalidParameter):
        prefix.release(hit)
    with pytest.raises(InvalidParameter):
        prefix.insert([1] * 10, _row(pool, [1] * 3), 0)  # more tokens than the row holds


def test_pool_reference_counts_free_slots_exactly_once():
    pool = KVPool(LAYERS, HEADS, DIM, torch.float32, slots=4)
    row = _row(pool, [5, 6, 7])
    assert pool.slots >= 4 and pool.used_slots == 3
    forks = row.fork([0, 0, 0])
    assert pool.used_slots == 3 and int(pool.refs[row.row_slots(0, 0, 3)].min()) == 4
    forks.truncate([3, 1, 0])
    row.release()
    assert pool.used_slots == 3  # row 0 of the fork still holds all three
    forks.release()
    assert pool.used_slots == 0 and int(pool.refs[1:].max()) == 0
    again = pool.allocate(2)
    assert sorted(again.tolist()) == sorted(np.unique(again).tolist())  # freed slots are handed out once


# --- generation --------------------------------------------------------------------------


def _extend(cache, tokens):
    """Append ``tokens``' keys to the one row of ``cache`` (a decode or verify step)."""
    start = int(cache.lengths[0])
    slots = cache.prepare([len(tokens)], len(tokens))
    for layer in range(LAYERS):
        k = torch.stack([_kv(list(range(start + len(tokens))), p, layer) for p in range(start, start + len(tokens))])
        cache.write(layer, k.transpose(0, 1)[None], -k.transpose(0, 1)[None], slots)
    cache.advance([len(tokens)])


def test_one_row_in_one_run_of_slots_is_read_in_place_and_equals_the_copy():
    pool = KVPool(LAYERS, HEADS, DIM, torch.float32, slots=64)
    row = _row(pool, [0, 1, 2, 3, 4])
    _extend(row, [5, 6, 7])  # a verify of three drafted tokens ...
    row.truncate([6])  # ... two rejected
    _extend(row, [6, 7])  # the next step takes the freed slots back in order: still one run
    start = row.run_start(8)
    assert start is not None
    for layer in range(LAYERS):
        copy_k, copy_v = row.gather(layer, 8)
        view_k, view_v = row.gather(layer, 8, start)
        assert torch.equal(view_k, copy_k) and torch.equal(view_v, copy_v)
        assert view_k.untyped_storage().data_ptr() == pool.keys[layer].untyped_storage().data_ptr()  # no copy
    # not one run: two rows, or one row whose slots interleave with another's
    assert row.fork([0, 0]).run_start(8) is None
    a, b = PagedKVCache(pool, 1, 64), PagedKVCache(pool, 1, 64)
    for _ in range(3):
        _extend(a, [1])
        _extend(b, [1])
    assert a.run_start(3) is None and b.run_start(3) is None

def _greedy(prompts, max_tokens=8):
    return [Request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]


def _ids(outs):
    return [[c.token_ids for c in out] for out in outs]


def test_tiny_model_cached_equals_uncached_for_a_batch_with_different_cached_lengths():
    loaded = tiny_llama()
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


def test_finished_samples_are_kept_so_a_continuation_prefills_one_token():
    loaded = tiny_llama()
    prefix = PrefixCache(budget_bytes=1 << 20)
    cached, plain = LocalGenerator(loaded, prefix_cache=prefix), LocalGenerator(loaded)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = cached.generate([Request("abcabc", params)], ledger=Ledger())[0][0]
    assert prefix.cached_tokens == 6 + 10 - 1  # the prompt and every generated token but the last (never fed)
    ledger = Ledger()
    more = cached.generate([Request("abcabc", params, prefix=first.token_ids)], ledger=ledger)[0][0]
    assert ledger.usage.input_tokens == 16 and ledger.usage.cached_tokens == 15  # only the last token computed
    whole = plain.generate([Request("abcabc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))],
                           ledger=Ledger())[0][0]
    assert first.token_ids + more.token_ids == whole.token_ids  # exact continuation


def test_prefix_cache_needs_a_block_cache_and_one_model():
    toy = LoadedModel(model=MarkovModel.random(5), tokenizer=CharTokenizer(5), name="toy", folder="", dtype=torch.float32)
    with pytest.raises(UnsupportedModel):
        LocalGenerator(toy, prefix_cache=PrefixCache(1 << 20))
    pool = PrefixCache(1 << 20)
    a = tiny_llama()
    first = LocalGenerator(a, prefix_cache=pool)
    with pytest.raises(InvalidParameter):  # one engine's KV pool per prefix cache
        LocalGenerator(a, prefix_cache=pool)
    del first  # once that engine is gone, its entries are of no use to anyone: the cache may serve another
    LocalGenerator(a, prefix_cache=pool)
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
