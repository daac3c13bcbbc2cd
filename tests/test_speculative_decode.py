"""The speculative decode loop end to end on toy Markov models: sampled outputs follow the
target's distribution whatever the drafter, greedy outputs equal plain greedy, rows of a batch
accept different counts, and the ledger counts drafts."""

import itertools

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.speculative import Draft, Speculative
from metaloom.speculative.drafters.draft_model import DraftModelDrafter
from metaloom.speculative.drafters.jacobi import JacobiDrafter
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.testing.stats import assert_samples_match
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

NEG = float("-inf")
V = 3
# target: token 0 -> mostly 1; token 1 -> never 1; token 2 -> anything
TARGET = torch.log(torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.0, 0.5], [0.3, 0.3, 0.4]]))


class FixedDrafter:
    """Always proposes the same tokens (q one-hot): an adversarial deterministic drafter."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def start(self, target, sampler, contexts, keys):
        return self

    def propose(self, contexts, limits, ledger):
        return Draft.from_lists([self.tokens[:limit] for limit in limits])

    def observe(self, verified):
        pass

    def select(self, rows):
        return self


def _generator(table, speculative=None, eos=None):
    loaded = LoadedModel(model=MarkovModel(table), tokenizer=CharTokenizer(table.shape[0], eos), name="toy", folder="",
                         dtype=torch.float32)
    return LocalGenerator(loaded, speculative=speculative)


def _joint(table):
    """p(x1, x2, x3) after the prompt token 0 (CharTokenizer: "a" = token 0)."""
    p = torch.softmax(table, dim=-1)
    out = torch.zeros([V] * 3, dtype=torch.float64)
    for a, b, c in itertools.product(range(V), repeat=3):
        out[a, b, c] = p[0, a] * p[a, b] * p[b, c]
    return out.flatten()


DRAFTERS = {
    "p equals q": lambda: DraftModelDrafter(MarkovModel(TARGET)),
    "disjoint supports": lambda: DraftModelDrafter(MarkovModel(torch.log(torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])))),  # proposes exactly what the target avoids after 1
    "draft zero where target positive": lambda: DraftModelDrafter(MarkovModel(torch.log(torch.tensor(
        [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])))),
    "one-hot impossible token": lambda: FixedDrafter([1, 1]),
    "prompt lookup": lambda: NgramDrafter(max_ngram=2),
}


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_sampled_joint_of_three_tokens_follows_the_target(name):
    n = 6000
    spec = Speculative(DRAFTERS[name](), num_draft=2)
    gen = _generator(TARGET, spec)
    ledger = Ledger()
    params = SamplingParams(temperature=1.0, n=n, max_tokens=4, seed=11)
    out = gen.generate([Request("a", params)], ledger=ledger)[0]
    first3 = torch.tensor([c.token_ids[:3] for c in out])
    counts = torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3)
    assert_samples_match(counts, _joint(TARGET))
    u = ledger.usage
    assert u.drafted_tokens > 0 and u.accepted_tokens + u.rejected_tokens == u.drafted_tokens
    assert u.output_tokens == 4 * n


def test_rows_accept_different_counts_in_one_batch():
    spec = Speculative(DraftModelDrafter(MarkovModel(TARGET + torch.randn(V, V, generator=torch.Generator().manual_seed(0)))),
                       num_draft=3)
    gen = _generator(TARGET, spec)
    ledger = Ledger()
    gen.generate([Request("a", SamplingParams(temperature=1.0, n=64, max_tokens=5, seed=1))], ledger=ledger)
    u = ledger.usage
    # some rows kept everything, some nothing: accepted per step strictly between 0 and K
    assert 0 < u.accepted_tokens < u.drafted_tokens
    assert 0 < u.accepted_per_step < 3


@pytest.mark.parametrize("drafter", [FixedDrafter([2, 2, 2]), NgramDrafter(), JacobiDrafter(), JacobiDrafter(fill="lookup"),
                                     DraftModelDrafter(MarkovModel.random(6, seed=5))])
def test_greedy_equals_plain_greedy_batched_with_eos_and_max_tokens(drafter):
    table = MarkovModel.random(6, seed=2, sharpness=1.5).table
    plain = _generator(table, eos=5)
    spec = _generator(table, Speculative(drafter, num_draft=3), eos=5)
    reqs = [Request(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in [("abcab", 9), ("c", 1), ("fed", 17), ("b", 2)]]
    assert spec.generate(reqs, ledger=Ledger()) == plain.generate(reqs, ledger=Ledger())


def test_greedy_and_sampled_rows_in_one_batch():
    table = MarkovModel.random(5, seed=3).table
    spec = _generator(table, Speculative(DraftModelDrafter(MarkovModel.random(5, seed=4)), num_draft=4))
    greedy = Request("ab", SamplingParams(temperature=0, max_tokens=12))
    sampled = Request("ab", SamplingParams(temperature=1.0, n=3, max_tokens=12, seed=0))
    out = spec.generate([sampled, greedy], ledger=Ledger())
    assert out[1] == _generator(table).generate([greedy], ledger=Ledger())[0]
    again = spec.generate([sampled, greedy], ledger=Ledger())
    assert out == again  # a seeded request is reproducible under speculation too


def test_stop_strings_and_streaming_match_plain():
    table = MarkovModel.random(4, seed=7, sharpness=0.5).table
    params = SamplingParams(temperature=0, max_tokens=30, stop=("ca",))
    plain = _generator(table).generate([Request("abc", params)], ledger=Ledger())[0][0]
    gen = _generator(table, Speculative(NgramDrafter(), num_draft=5))
    assert gen.generate([Request("abc", params)], ledger=Ledger())[0][0] == plain
    chunks = list(gen.stream(Request("abc", params), ledger=Ledger()))
    assert "".join(c.text for c in chunks) == plain.text
    assert tuple(t for c in chunks for t in c.token_ids) == plain.token_ids
    assert chunks[-1].finish_reason == plain.finish_reason


def test_ledger_counts_a_perfect_drafter():
    table = MarkovModel.random(5, seed=9).table
    gen = _generator(table, Speculative(DraftModelDrafter(MarkovModel(table)), num_draft=4))
    ledger = Ledger()
    gen.generate([Request("a", SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))], ledger=ledger)
    u = ledger.usage
    # step 0 from the prefill, then two steps of 4 accepted + 1 bonus
    assert (u.drafted_tokens, u.accepted_tokens, u.rejected_tokens, u.verify_steps) == (8, 8, 0, 2)
    assert u.acceptance_rate == 1.0 and u.accepted_per_step == 4.0
    assert u.output_tokens == 11


class Silent(FixedDrafter):
    """Drafts nothing on alternate steps (as the cost model does when nothing pays) and records
    what it observes."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.calls, self.drafted, self.seen = 0, 0, []

    def propose(self, contexts, limits, ledger):
        self.calls += 1
        drafts = [self.tokens[:limit] if self.calls % 2 == 0 else [] for limit in limits]
        self.drafted += any(drafts)
        return Draft.from_lists(drafts)

    def observe(self, verified):
        self.seen.append((verified.draft.tokens.shape[1], verified.accepted.tolist(),
                          [verified.tokens[b, :int(a) + 1].tolist() for b, a in enumerate(verified.accepted)],
                          tuple(verified.logits.shape)))


def test_a_step_nothing_is_drafted_for_is_the_plain_step_and_is_still_observed(monkeypatch):
    """An empty draft skips verification (its acceptance and rollback cost a small model's plain
    step about a fifth): the tokens, log-probabilities and ledger of plain decoding, each step
    still one of the speculative decoder's (``verify_steps``), and the drafter sees the emitted
    token and the target's logits."""
    import metaloom.decode.speculative_step as step

    table = MarkovModel.random(5, seed=11, sharpness=1.5).table
    calls = []
    real_verify = step.verify
    monkeypatch.setattr(step, "verify", lambda *a, **k: calls.append(1) or real_verify(*a, **k))
    for params in (SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                   SamplingParams(temperature=1.0, n=3, max_tokens=9, ignore_eos=True, seed=3)):
        calls.clear()
        drafter = Silent([1, 2])
        ledger = Ledger()
        req = Request("ab", params)
        got = _generator(table, Speculative(drafter, num_draft=2)).generate([req], ledger=ledger)
        assert got == _generator(table).generate([req], ledger=Ledger())
        assert len(calls) == drafter.drafted > 0  # only the steps that drafted went through verify
        empty = [s for s in drafter.seen if s[0] == 0]
        assert len(empty) == drafter.calls - len(calls) > 0
        for _, accepted, emitted, shape in empty:
            assert not any(accepted) and all(len(e) == 1 for e in emitted) and shape == (len(accepted), 1, 5)
        never, ledger, before = Silent([]), Ledger(), len(calls)
        assert _generator(table, Speculative(never, num_draft=2)).generate([req], ledger=ledger) == got
        assert len(calls) == before and len(never.seen) == never.calls > 0
        # each row's tokens after the prefill's first came one a step, each step one of the decoder's
        assert ledger.usage.verify_steps == ledger.usage.output_tokens - params.n > 0


def test_num_draft_is_validated():
    with pytest.raises(InvalidParameter):
        Speculative(NgramDrafter(), num_draft=0)
    with pytest.raises(InvalidParameter):
        NgramDrafter(max_ngram=0)
