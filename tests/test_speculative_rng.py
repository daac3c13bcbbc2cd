"""One random-number scheme (`metaloom.sampling.counter`) for every draw of speculative decoding:
a seeded speculative row emits plain sampling's tokens, whatever batch it runs in, whatever the
drafter (chains, a sampling draft model, token trees) and whatever the cost model chooses to
verify; no torch RNG is touched, and the tree acceptance reads the device a fixed number of
times however many children it tries."""

import numpy as np
import pytest
import torch

from metaloom.decode.tree_verify import verify_tree
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models.load import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.sampling.counter import row_key
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative import Draft, Speculative
from metaloom.speculative.cost import VerifyCost
from metaloom.speculative.drafters.draft_model import DraftModelDrafter
from metaloom.speculative.drafters.ngram import NgramDrafter
from metaloom.speculative.drafters.ngram_tree import NgramTreeDrafter
from metaloom.speculative.drafters.recycling import RecyclingDrafter
from metaloom.speculative.planned import PlannedDrafter
from metaloom.speculative.tree import DraftTree, TreeShape
from metaloom.testing.tiny import tiny_llama
from metaloom.testing.toy_models import CharTokenizer, MarkovModel

V = 6
TARGET = torch.log_softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 1.5, dim=-1)
DRAFT_TABLE = torch.log_softmax(TARGET + torch.randn(V, V, generator=torch.Generator().manual_seed(1)), dim=-1)


class Empty:
    name = "empty"

    def start(self, target, sampler, contexts, keys):
        return self

    def propose(self, contexts, limits, ledger):
        return Draft.from_lists([[] for _ in contexts])

    def observe(self, verified):
        pass

    def select(self, rows):
        return self

    def join(self, other):
        return self


def _generate(drafter, requests, loaded=None):
    loaded = loaded or LoadedModel(model=MarkovModel(TARGET), tokenizer=CharTokenizer(V, None), name="toy", folder="",
                                   dtype=torch.float32)
    spec = None if drafter is None else Speculative(drafter(), 3)
    out = LocalGenerator(loaded, speculative=spec).generate(requests, ledger=Ledger())
    return [[c.token_ids for c in row] for row in out]


def _request(prompt, seed, n=1, temperature=1.0):
    return Request(prompt, SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=40, ignore_eos=True))


DRAFTERS = {"ngram": lambda: NgramDrafter(max_ngram=2),
            "draft model": lambda: DraftModelDrafter(MarkovModel(DRAFT_TABLE)),
            "ngram, cost model": lambda: PlannedDrafter([(NgramDrafter(max_ngram=2), 3)], cost=FLAT),
            "auto": lambda: PlannedDrafter([(NgramDrafter(max_ngram=2), 3),
                                            (DraftModelDrafter(MarkovModel(DRAFT_TABLE)), 3)], cost=FLAT)}
FLAT = VerifyCost((1, 8), (1.0, 1.0))


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_seeded_speculative_row_is_plain_sampling_in_any_batch(name, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a torch RNG was used: every draw goes through the counter scheme")

    a = _request("abcab", seed=11)
    crowd_requests = [_request("ba", seed=3, n=2), a, _request("cabca", seed=5, temperature=0.7)]
    plain = _generate(None, [a])[0]
    plain_crowd = _generate(None, crowd_requests)
    monkeypatch.setattr(torch, "rand", refuse)
    monkeypatch.setattr(torch, "multinomial", refuse)
    assert _generate(DRAFTERS[name], [a])[0] == plain
    assert _generate(DRAFTERS[name], crowd_requests) == plain_crowd
    assert plain_crowd[1] == plain


@pytest.mark.parametrize("tree", ["ngram", "recycling", "recycling, cost model"])
def test_a_seeded_token_tree_row_is_plain_sampling_in_any_batch(tree):
    """Trees need the native engine: a tiny random Llama (float32; its verify and one-token
    logits agree to rounding, and a draw moves only when a uniform falls within it of a CDF step)."""
    loaded = tiny_llama(vocab=V)
    drafter = {"ngram": lambda: NgramTreeDrafter(TreeShape((2, 2))),
               "recycling": lambda: RecyclingDrafter(TreeShape((3, 2))),
               "recycling, cost model": lambda: PlannedDrafter([(RecyclingDrafter(TreeShape((3, 2))), 8)],
                                                               cost=FLAT)}[tree]
    a = _request("abcab", seed=11)
    crowd = [_request("ba", seed=3, n=2), a, _request("cabca", seed=5, temperature=0.7)]
    assert _generate(drafter, [a], loaded)[0] == _generate(None, [a], loaded)[0]
    assert _generate(drafter, crowd, loaded) == _generate(None, crowd, loaded)


def test_speculation_confirms_several_draws_a_step():
    """Not vacuous: the drafters above are accepted (the same tokens in fewer forwards)."""
    loaded = LoadedModel(model=MarkovModel(TARGET), tokenizer=CharTokenizer(V, None), name="toy", folder="",
                         dtype=torch.float32)
    ledger = Ledger()
    LocalGenerator(loaded, speculative=Speculative(DraftModelDrafter(MarkovModel(TARGET)), 3)).generate(
        [_request("abc", seed=1)], ledger=ledger)
    assert ledger.usage.accepted_tokens > 20 and ledger.usage.verify_steps < 25


def test_an_empty_draft_draws_what_plain_sampling_draws():
    requests = [_request("abc", seed=11, n=3), _request("b", seed=2, temperature=0.6)]
    assert _generate(Empty, requests) == _generate(None, requests)


def _tree(children):
    """The root with ``children`` children (tokens 0..children-1), each with one child (token 5)."""
    tokens = list(range(children)) + [5] * children
    parents = [-1] * children + list(range(children))
    return DraftTree(tuple(tokens), tuple(parents))


def _verify(trees, scores, keys, seeds):
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds]
    sampler = make_sampler(params, V)
    state = sampler.start([[0]] * len(trees))
    draft = Draft.from_trees(trees)
    return verify_tree(sampler, state, scores[:, :draft.tokens.shape[1] + 1], draft, None, [None] * len(trees), keys)


def test_tree_acceptance_of_a_row_is_the_same_in_any_batch():
    scores = torch.randn(3, 9, V, generator=torch.Generator().manual_seed(4))
    trees = [_tree(2), _tree(4), _tree(3)]
    keys = np.array([(row_key(s, 0), 9 + s) for s in (1, 2, 3)], dtype=np.int64)
    together = _verify(trees, scores, keys, (1, 2, 3))
    for r in range(3):
        alone = _verify([trees[r]], scores[r:r + 1], keys[r:r + 1], (r + 1,))
        assert alone.tokens[0] == together.tokens[r] and alone.positions[0] == together.positions[r]


def test_tree_acceptance_reads_the_device_a_fixed_number_of_times(monkeypatch):
    """Children all rejected (the target's mass sits on a token no child proposes): the walk
    tries every child, yet the number of reads to the host does not grow with them."""
    counts = {}

    def counting(name, original):
        def read(self, *args, **kwargs):
            counts["reads"] = counts.get("reads", 0) + 1
            return original(self, *args, **kwargs)

        return read

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    logits = torch.full((1, 9, V), -30.0)
    logits[..., V - 1] = 0.0  # token 5 after every position: no child of the root proposes it
    keys = np.array([(row_key(0, 0), 0)], dtype=np.int64)
    reads = []
    for children in (1, 4):
        counts.clear()
        out = _verify([_tree(children)], logits, keys, (0,))
        assert out.tokens == [[V - 1]]  # every child rejected, the final token drawn from the residual
        reads.append(counts["reads"])
    assert reads[0] == reads[1] <= 4
