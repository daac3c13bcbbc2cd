"""Token dropping (``--kv-policy``): the kept sets on hand-made attention patterns
(metaloom.models.engine.kv_policy), eviction in the slot table (refcounts, forks, the prefix
cache), the fused kernel's shifted positions, sinks and attention probabilities against a
reference written out here, the PyTorch path against the fused path under every policy, and
``full`` identical to the engine without the option. Kernel tests run once per instruction-set
path this CPU runs (the ``path_kernels`` fixture)."""

import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.engine.kv_policy import SINKS, SNAP_WINDOW, check_policy, h2o_keep, snapkv_keep, streaming_keep
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.rope import apply_rope, rope_tables
from metaloom.models.engine.sharing import find_sharing
from metaloom.models.kernels.fused import Drops, kernels
from metaloom.prefix.pool import PrefixCache
from tests.test_fused import _as, _tiny

CPU = torch.device("cpu")
KERNELS = kernels().kernels
KERNELS_OF = kernels
needs = pytest.mark.skipif(KERNELS is None, reason=f"no fused kernels here: {kernels().reason}")


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- the kept sets --------------------------------------------------------------------------

def test_streaming_keeps_the_sinks_and_the_most_recent():
    assert streaming_keep(10, 6).tolist() == [0, 1, 2, 3, 8, 9]
    assert streaming_keep(5, 5).tolist() == [0, 1, 2, 3, 4]  # at the budget: all
    assert streaming_keep(20, 5, sinks=2).tolist() == [0, 1, 17, 18, 19]


def test_h2o_keeps_half_recent_and_the_heaviest_older_ones():
    mass = np.array([5.0, 1.0, 3.0, 0.0, 2.0, 7.0, 0.5, 0.1])
    # keep 4: the last 2 (6, 7) and the 2 heaviest of 0..5 (5: 7.0, 0: 5.0)
    assert h2o_keep(mass, 4).tolist() == [0, 5, 6, 7]
    # keep 5: recent 2, heavy 3 (5, 0, 2)
    assert h2o_keep(mass, 5).tolist() == [0, 2, 5, 6, 7]
    assert h2o_keep(np.zeros(6), 4).tolist() == [0, 1, 4, 5]  # ties: the older entries


def test_snapkv_keeps_the_window_and_the_pooled_top_votes():
    votes = np.zeros(20)
    votes[9] = 10.0  # one spike: pooling spreads it over 7..11, each 2.0
    votes[2] = 4.0  # a weaker one: 0.8 over 0..4
    kept = snapkv_keep(votes, SNAP_WINDOW + 6)
    window = list(range(20, 20 + SNAP_WINDOW))
    assert kept.tolist() == [0, 7, 8, 9, 10, 11, *window]  # 7..11 at 2.0, then the first of 0..4 at 0.8
    # the spike alone without pooling would keep 9 and then the 2 run: pooling is what brings 7..11
    assert snapkv_keep(votes, SNAP_WINDOW + 1).tolist() == [7, *window]
    assert snapkv_keep(np.zeros(3), 40).tolist() == list(range(3 + SNAP_WINDOW))  # under the budget: all


def test_bad_policies_and_budgets_are_typed_errors_naming_the_parameter():
    cases = [("lru", 10, "kv_policy"), ("streaming", SINKS, "kv_budget"), ("h2o", None, "kv_budget"),
             ("snapkv", SNAP_WINDOW, "kv_budget"), ("full", 64, "kv_budget"), ("h2o", 10.5, "kv_budget"),
             ("h2o", True, "kv_budget")]
    for policy, budget, name in cases:
        with pytest.raises(InvalidParameter) as err:
            EngineOptions(kv_policy=policy, kv_budget=budget)
        assert err.value.name == name, (policy, budget)
    check_policy("streaming", SINKS + 1)  # the smallest that runs
    with pytest.raises(InvalidParameter, match="sliding window"):
        _tiny("mistral", sliding_window=6).with_options(EngineOptions(kv_policy="h2o", kv_budget=8))


# --- eviction in the slot table --------------------------------------------------------------

def test_evict_compacts_the_row_and_frees_only_unshared_slots():
    model = _tiny()
    cache = model.new_cache(1, 32)
    model.forward(torch.arange(10)[None], cache)
    pool = cache.pool
    fork = cache.fork([0])  # shares all 10 slots
    slots = cache.slots[0, :10].copy()
    used = pool.used_slots
    assert cache.evict(0, np.array([0, 1, 7, 8, 9]), sinks=2) == 5
    assert cache.host_lengths().tolist() == [5] and cache.shift.tolist() == [5] and cache.sinks.tolist() == [2]
    assert cache.slots[0, :5].tolist() == slots[[0, 1, 7, 8, 9]].tolist()
    assert cache.host_positions().tolist() == [10]
    assert pool.used_slots == used  # the fork still holds the dropped slots
    assert fork.slots[0, :10].tolist() == slots.tolist() and fork.shift.tolist() == [0]
    fork.release()
    assert pool.used_slots == used - 5  # now they are free
    with pytest.raises(InvalidParameter):
        cache.row_slots(0, 0, 3)  # entries are not positions any more
    with pytest.raises(InvalidParameter):
        cache.evict(0, np.array([3, 1]))
    again = cache.fork([0, 0])  # a fork carries the shift and sinks
    assert again.shift.tolist() == [5, 5] and again.sinks.tolist() == [2, 2]
    cache.release()
    again.release()
    assert pool.used_slots == 0


def test_a_row_that_dropped_positions_is_not_stored_in_the_prefix_cache():
    model = _tiny()
    prefix = PrefixCache(budget_bytes=1 << 20)
    pool = model.new_pool()
    prefix.bind(pool)
    cache = model.new_cache(2, 32, pool)
    model.forward(torch.arange(12).view(2, 6), cache)
    cache.evict(1, np.array([0, 4, 5]))
    assert prefix.insert(list(range(6)), cache, 0) == 6
    assert prefix.insert(list(range(6, 12)), cache, 1) == 0
    assert prefix.cached_tokens == 6


# --- the kernel ------------------------------------------------------------------------------

def _reference(qkv, cos, sin, lengths, shift, sinks, table, keys, values, heads):
    """Row r's new token at entry n = lengths[r], position n + shift[r]: the key rotated at the
    position into slot table[r, n]; each query head rotated at the position for entries
    sinks[r]..n and at n (its in-cache position) for entries 0..sinks[r]-1, softmax over all,
    times the values. Also each entry's probability summed over the group's query heads."""
    _, kv_heads, dim = keys.shape
    group = heads // kv_heads
    outs, probs = [], torch.zeros(len(lengths), kv_heads, table.shape[1])
    for r in range(len(lengths)):
        n, p, s = int(lengths[r]), int(lengths[r] + shift[r]), int(sinks[r])
        x = qkv[r].float().view(heads + 2 * kv_heads, dim)
        rot = apply_rope(x[None, :, None], cos[p].float()[None, None, None], sin[p].float()[None, None, None])[0, :, 0]
        q_in = apply_rope(x[None, :heads, None], cos[n].float()[None, None, None], sin[n].float()[None, None, None])
        slot = int(table[r, n])
        keys[slot] = rot[heads:heads + kv_heads].to(keys.dtype)
        values[slot] = x[heads + kv_heads:].to(values.dtype)
        k, v = keys[table[r, :n + 1]].float(), values[table[r, :n + 1]].float()  # [n+1, kv, dim]
        out = []
        for g in range(heads):
            j = g // group
            scores = k[:, j] @ rot[g]
            scores[:s] = k[:s, j] @ q_in[0, g, 0]
            w = torch.softmax(scores / dim ** 0.5, 0)
            probs[r, j, :n + 1] += w
            out.append(w @ v[:, j])
        outs.append(torch.cat(out))
    return torch.stack(outs), probs


@needs
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 1, 128), (2, 2, 96)])
def test_kernel_attends_shifted_positions_sinks_in_cache_and_reports_probabilities(heads, kv_heads, dim, dtype,
                                                                                  threads):
    rows, cap, slots = 4, 40, 200
    lengths = torch.tensor([0, 7, 33, 20])
    shift = torch.tensor([0, 9, 3, 50])
    sinks = torch.tensor([0, 4, 0, 4])  # row 0 fresh, row 2 h2o-like (shifted, no sinks)
    cos, sin = rope_tables(dim, 10000.0, None, 128, dtype, CPU)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=_g(5)).to(dtype)
    keys = torch.randn(slots, kv_heads, dim, generator=_g(6)).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=_g(7)).to(dtype)
    table = torch.randperm(slots, generator=_g(8))[:rows * cap].view(rows, cap).clone()
    ref_keys, ref_values = keys.clone(), values.clone()
    expected, expected_probs = _reference(qkv, cos, sin, lengths, shift, sinks, table, ref_keys, ref_values, heads)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    out = torch.empty(rows, heads * dim, dtype=dtype)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, None, threads,
                        drops=Drops(shift, sinks))
    assert (out.float() - expected).abs().max().item() <= tol * 4
    assert (keys.float() - ref_keys.float()).abs().max().item() <= tol  # the key rotated at its position
    # probabilities (no sinks: the kernel reports them for rows without, as H2O's are)
    plain = torch.zeros_like(sinks)
    expected, expected_probs = _reference(qkv, cos, sin, lengths, shift, plain, table, keys.clone(), values.clone(),
                                          heads)
    probs = torch.zeros(rows, kv_heads, cap)
    KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, None, threads,
                        drops=Drops(shift, None, probs))
    assert (out.float() - expected).abs().max().item() <= tol * 4
    assert (probs - expected_probs).abs().max().item() <= {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]
    assert torch.allclose(probs.sum((1, 2)), torch.full((rows,), float(heads)))  # each head's sum to 1


@needs
def test_kernel_refuses_sinks_or_probabilities_with_shared_prefix_attention():
    heads, kv_heads, dim = 2, 1, 64
    cos, sin = rope_tables(dim, 10000.0, None, 64, torch.float32, CPU)
    table = torch.arange(1, 41).view(2, 20)
    table[1, :10] = table[0, :10]
    lengths = torch.tensor([12, 12])
    sharing = find_sharing(table.numpy(), lengths.numpy(), piece=512)
    assert sharing is not None
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim)
    keys, values = torch.randn(64, kv_heads, dim), torch.randn(64, kv_heads, dim)
    out = torch.empty(2, heads * dim)
    with pytest.raises(UnsupportedModel, match="sinks"):
        KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, None, 1, sharing,
                            drops=Drops(torch.tensor([3, 3]), torch.tensor([4, 4])))
    with pytest.raises(UnsupportedModel, match="sliding window"):
        KERNELS.rope_attend(qkv, cos, sin, lengths, table, keys, values, out, heads, 6, 1,
                            drops=Drops(torch.tensor([3, 3])))


# --- models ----------------------------------------------------------------------------------

def _run(model, prompts, valid, steps, forced=None):
    """Greedy (or ``forced``) decoding of rows of different lengths: logits per step, the cache."""
    cache = model.new_cache(prompts.shape[0], 96)
    logits = model.forward(prompts, cache, valid=valid, last_only=True)[:, -1]
    out = [logits]
    for i in range(steps):
        token = logits.argmax(-1, keepdim=True) if forced is None else forced[:, i:i + 1]
        logits = model.forward(token, cache)[:, -1]
        out.append(logits)
    return out, cache


POLICIES = [("streaming", 12), ("h2o", 12), ("snapkv", SNAP_WINDOW + 4)]


@needs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy, budget", POLICIES)
def test_fused_steps_equal_pytorch_steps_under_every_policy(policy, budget, dtype):
    options = EngineOptions(kv_policy=policy, kv_budget=budget)
    plain = _as(_tiny(), dtype).with_options(options)
    fused = plain.with_fused(KERNELS)
    n = 40 if policy == "snapkv" else 9  # snapkv compresses prompts: one past the budget
    prompts = torch.randint(0, 103, (3, n), generator=_g(8))
    valid = torch.tensor([n, n - 5, 3])
    forced = torch.randint(0, 103, (3, 30), generator=_g(9))
    tol = {torch.float32: 1e-4, torch.bfloat16: 0.15}[dtype]
    (a, ca), (b, cb) = (_run(m, prompts, valid, 30, forced) for m in (plain, fused))
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert (x.float() - y.float()).abs().max().item() <= tol * max(1.0, x.abs().max().item()), step
    assert ca.host_lengths().tolist() == cb.host_lengths().tolist()
    assert ca.shift.tolist() == cb.shift.tolist() and ca.shift.any()  # something was dropped
    if policy != "snapkv":
        assert max(ca.host_lengths()) <= budget  # every row held to its budget
    else:
        assert ca.host_lengths()[0] == budget + 30  # the prompt compressed, decoding appended
    assert (ca.host_positions() == valid.numpy() + 30).all()  # positions run on through the drops
    if policy == "h2o":
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]  # bfloat16: queries rounded differently
        assert np.allclose(ca.mass, cb.mass, rtol=rtol, atol=1e-3)
    for c in (ca, cb):
        c.release()


@needs
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_a_budget_never_reached_changes_nothing(policy):
    base = _tiny().with_fused(KERNELS)
    roomy = base.with_options(EngineOptions(kv_policy=policy, kv_budget=90))
    prompts = torch.randint(0, 103, (2, 9), generator=_g(3))
    valid = torch.tensor([9, 4])
    (a, _ca), (b, cb) = (_run(m, prompts, valid, 25) for m in (base, roomy))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert (x - y).abs().max().item() <= 1e-4
    assert not cb.shift.any()


def test_full_with_float32_kv_is_todays_engine_bit_for_bit():
    base = _tiny()
    explicit = base.with_options(EngineOptions(kv_policy="full", kv_dtype="float32"))
    prompts = torch.randint(0, 103, (2, 9), generator=_g(4))
    valid = torch.tensor([9, 4])
    (a, _), (b, _) = (_run(m, prompts, valid, 20) for m in (base, explicit))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@needs
def test_h2o_mass_is_every_query_probability_summed():
    """Each query head's probabilities sum to 1: after a prompt of n tokens and s steps, a row's
    mass over its entries (kept and dropped) is (n + s) x heads x layers; kept ones hold part."""
    model = _tiny().with_fused(KERNELS).with_options(EngineOptions(kv_policy="h2o", kv_budget=90))
    c = model.config
    cache = model.new_cache(1, 96)
    model.forward(torch.arange(10)[None], cache)  # the PyTorch path's probabilities
    for t in range(5):  # the fused kernel's
        model.forward(torch.tensor([[t]]), cache)
    total = cache.mass[0, :15].sum()
    assert abs(total - 15 * c.num_attention_heads * c.num_hidden_layers) < 1e-3


@needs
@pytest.mark.parametrize("policy, budget", POLICIES)
def test_forked_rows_drop_on_their_own_without_touching_each_other(policy, budget):
    """Two rows forked from one prompt, each then forced down its own tokens, equal the same
    rows decoded alone: one row's eviction never frees or moves a slot the other reads."""
    model = _tiny().with_fused(KERNELS).with_options(EngineOptions(kv_policy=policy, kv_budget=budget))
    n = 40 if policy == "snapkv" else 8
    prompt = torch.randint(0, 103, (1, n), generator=_g(11))
    forced = torch.randint(0, 103, (2, 20), generator=_g(12))
    cache = model.new_cache(1, 96)
    model.forward(prompt, cache)
    forks = cache.fork([0, 0])
    cache.release()
    together = [model.forward(forced[:, i:i + 1], forks)[:, -1] for i in range(20)]
    for r in range(2):
        alone = model.new_cache(1, 96)
        model.forward(prompt, alone)
        for i in range(20):
            logits = model.forward(forced[r:r + 1, i:i + 1], alone)[:, -1]
            assert (logits[0] - together[i][r]).abs().max().item() <= 1e-4, (r, i)
        alone.release()
    pool = forks.pool
    forks.release()
    assert pool.used_slots == 0


@needs
def test_streaming_memory_stays_within_the_budget_over_a_long_decode():
    model = _tiny().with_fused(KERNELS).with_options(EngineOptions(kv_policy="streaming", kv_budget=16))
    cache = model.new_cache(2, 120)
    model.forward(torch.randint(0, 103, (2, 10), generator=_g(1)), cache)
    peak = 0
    for t in range(100):
        model.forward(torch.tensor([[t % 103], [(3 * t) % 103]]), cache)
        peak = max(peak, cache.pool.used_slots)
    assert peak <= 2 * 16
    assert cache.host_positions().tolist() == [110, 110]
    assert cache.sinks.tolist() == [SINKS, SINKS]


# --- through the generator -----------------------------------------------------------------

def _tiny_with(options: EngineOptions):
    import dataclasses

    from metaloom.testing.tiny import tiny_llama

    loaded = tiny_llama()
    return dataclasses.replace(loaded, model=loaded.model.with_options(options))


def test_generated_samples_hold_their_budget_in_the_ledger():
    """40 tokens from an 8-token prompt, 4 samples under streaming:10: the ledger's peak is the
    prompt once, then each row's own entries up to 10 (its share of the prompt's sinks and
    recent positions still held by the shared slots), far below the full cache's."""
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, n=4, seed=3)
    peaks = {}
    for name, options in (("full", EngineOptions()), ("streaming", EngineOptions(kv_policy="streaming", kv_budget=10))):
        ledger = Ledger()
        out = LocalGenerator(_tiny_with(options)).generate([Request("abcdefgh", params)], ledger=ledger)
        assert [len(c.token_ids) for c in out[0]] == [40] * 4
        peaks[name] = ledger.usage.kv_bytes_peak
    slot = 256
    assert peaks["full"] == (8 + 4 * 39) * slot
    assert peaks["streaming"] <= (8 + 4 * 10) * slot  # the prompt's slots, and at most 10 entries a row


def test_speculative_decoding_with_a_dropping_policy_is_refused_by_name():
    from metaloom.generator.local import LocalGenerator
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.ngram import NgramDrafter

    with pytest.raises(InvalidParameter) as err:
        LocalGenerator(_tiny_with(EngineOptions(kv_policy="h2o", kv_budget=8)), speculative=Speculative(NgramDrafter()))
    assert err.value.name == "speculative"


def test_scoring_prompts_that_share_a_beginning_never_reuses_a_cache_that_dropped():
    from metaloom.decode.score import prompt_logprobs, shared_prompt_logprobs
    from metaloom.ledger import Ledger

    loaded = _tiny_with(EngineOptions(kv_policy="streaming", kv_budget=8))
    prompts = [list(range(20)), [*range(16), 3, 3, 3, 3]]
    together = shared_prompt_logprobs(loaded.model, prompts, 0, Ledger())
    for prompt, got in zip(prompts, together, strict=True):
        alone = prompt_logprobs(loaded.model, prompt, 0, Ledger())
        assert [p.logprob for p in got] == pytest.approx([p.logprob for p in alone], abs=1e-5)
