"""Admission prefills prompts of very different lengths in separate forwards (`prefill_groups`):
the split is the cheapest under its cost model, and the outputs are those of one padded forward."""


import pytest
import torch

from metaloom.decode import overhead as overhead_mod
from metaloom.decode.joining import prefill_groups
from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.testing.toy_models import CharTokenizer, MarkovModel


@pytest.mark.parametrize(("lengths", "overhead", "groups"), [
    ([], 48, []),
    ([7], 48, [[0]]),
    ([5, 400], 48, [[0], [1]]),  # 48+5 + 48+400 = 501 < 48 + 2*400
    ([100, 110, 120], 48, [[0, 1, 2]]),  # 408 in one forward < 474 in three
    ([400, 5, 390, 6], 48, [[1, 3], [0, 2]]),  # groups follow length, indices keep the caller's order
    ([10, 20, 30], 0, [[0], [1], [2]]),  # free forwards: no padding at all
    ([10, 20, 30], 10**6, [[0, 1, 2]]),  # dear forwards: one
])
def test_prefill_groups_are_the_cheapest_split(lengths, overhead, groups):
    assert prefill_groups(lengths, overhead) == groups


def test_brute_force_agrees_on_small_cases():
    rng = torch.Generator().manual_seed(0)
    for _ in range(30):
        lengths = torch.randint(1, 200, (5,), generator=rng).tolist()
        got = prefill_groups(lengths, 40)

        def cost(parts, lengths=lengths):
            return sum(40 + len(p) * max(lengths[i] for i in p) for p in parts)

        best = min(cost(parts) for parts in _partitions(list(range(5))))
        assert cost(got) == best and sorted(i for p in got for i in p) == list(range(5))


def _partitions(items):
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for part in _partitions(rest):
        for k in range(len(part)):
            yield [*part[:k], [head, *part[k]], *part[k + 1:]]
        yield [[head], *part]


def test_mixed_lengths_prefill_in_two_forwards_and_decode_as_each_alone():
    model = MarkovModel.random(6, seed=2)
    gen = LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(6), name="toy", folder="", dtype=torch.float32),
                         prefill_overhead_tokens=48)
    requests = [Request("ab", SamplingParams(temperature=0.7, seed=1, max_tokens=5)),
                Request("abcdef" * 60, SamplingParams(temperature=0.7, seed=2, max_tokens=5))]
    ledger = Ledger()
    together = gen.generate(requests, ledger=ledger)
    alone = [gen.generate([r], ledger=Ledger())[0] for r in requests]
    assert [c[0].token_ids for c in together] == [c[0].token_ids for c in alone]
    # two prefill forwards (a 2-token and a 360-token prompt), then 4 decode steps
    assert ledger.usage.forward_passes == 2 + 4


class _Clock:
    """The overhead measurement's clock, advanced by the model's forwards instead of by sleeping:
    a timed test would read the machine's load (under load a 2 ms sleep overshoots, and the
    measured overhead came out 8192 tokens instead of 64)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _TimedModel(MarkovModel):
    """A forward of n tokens takes FIXED + PER_TOKEN * n seconds on `clock`: an overhead of 50 tokens."""
    FIXED, PER_TOKEN = 0.002, 0.00004
    clock = _Clock()

    def forward(self, tokens, cache, *, valid=None, last_only=False):
        self.clock.now += self.FIXED + self.PER_TOKEN * tokens.shape[1]
        return super().forward(tokens, cache, valid=valid, last_only=last_only)


@pytest.mark.parametrize(("one", "probe", "tokens", "expected"), [
    (0.010, 0.010 + 63 * 0.0002, 64, 64),   # fixed 9.8 ms, 0.2 ms a token: 49 -> 64
    (0.0021, 0.0021 + 63 * 0.0001, 64, 16),  # fixed 2.0 ms, 0.1 ms a token: 20 -> 16
    (0.001, 0.001 + 63 * 0.001, 64, 1),      # no fixed cost at all: never below 1
    (0.005, 0.005, 64, overhead_mod.MAX_TOKENS),  # all fixed cost (a GPU far from saturation): one forward
    (0.005, 0.004, 64, overhead_mod.MAX_TOKENS),  # noise: the probe came out faster
])
def test_overhead_tokens_from_two_timings(one, probe, tokens, expected):
    assert overhead_mod.overhead_tokens(one, probe, tokens) == expected


def test_overhead_is_measured_once_and_only_for_mixed_lengths(monkeypatch):
    model = _TimedModel.random(6, seed=2)
    monkeypatch.setattr(overhead_mod, "time", model.clock)
    gen = LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(6), name="toy", folder="", dtype=torch.float32))
    calls = []
    real = overhead_mod.measure_overhead

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr("metaloom.generator.local.measure_overhead", counted)
    same = [Request("abc", SamplingParams(temperature=0, max_tokens=2)) for _ in range(3)]
    gen.generate(same, ledger=Ledger())
    assert calls == []  # one length: nothing to weigh
    mixed = [Request("ab", SamplingParams(temperature=0, max_tokens=2)),
             Request("abcdef" * 60, SamplingParams(temperature=0, max_tokens=2))]
    ledger = Ledger()
    gen.generate(mixed, ledger=ledger)
    gen.generate(mixed, ledger=Ledger())
    assert calls == [1]
    # 2 ms + 0.04 ms a token is an overhead of 50 tokens, 64 once rounded: the 2-token and the
    # 360-token prompt (358 wasted positions) go in two forwards, then one decode step
    assert gen.prefill_overhead_tokens() == 64
    assert ledger.usage.forward_passes == 2 + 1


def test_given_overhead_is_used_and_checked():
    model = MarkovModel.random(6, seed=2)
    loaded = LoadedModel(model=model, tokenizer=CharTokenizer(6), name="toy", folder="", dtype=torch.float32)
    mixed = [Request("ab", SamplingParams(temperature=0, max_tokens=2)),
             Request("abcdef" * 60, SamplingParams(temperature=0, max_tokens=2))]
    ledger = Ledger()
    LocalGenerator(loaded, prefill_overhead_tokens=10**6).generate(mixed, ledger=ledger)
    assert ledger.usage.forward_passes == 1 + 1  # padding is cheaper than a million-token overhead
    with pytest.raises(InvalidParameter, match="prefill_overhead_tokens"):
        LocalGenerator(loaded, prefill_overhead_tokens=-1)
