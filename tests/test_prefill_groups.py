"""Admission prefills prompts of very different lengths in separate forwards (`prefill_groups`):
the split is the cheapest under its cost model, and the outputs are those of one padded forward."""

import pytest
import torch

from metaloom.decode.batch import prefill_groups
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
    gen = LocalGenerator(LoadedModel(model=model, tokenizer=CharTokenizer(6), name="toy", folder="", dtype=torch.float32))
    requests = [Request("ab", SamplingParams(temperature=0.7, seed=1, max_tokens=5)),
                Request("abcdef" * 60, SamplingParams(temperature=0.7, seed=2, max_tokens=5))]
    ledger = Ledger()
    together = gen.generate(requests, ledger=ledger)
    alone = [gen.generate([r], ledger=Ledger())[0] for r in requests]
    assert [c[0].token_ids for c in together] == [c[0].token_ids for c in alone]
    # two prefill forwards (a 2-token and a 360-token prompt), then 4 decode steps
    assert ledger.usage.forward_passes == 2 + 4
