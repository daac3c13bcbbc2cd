"""Tree drafters of issue 32 beyond Token Recycling and the draft model: n-gram lookup with every
earlier occurrence's continuation merged into a trie (`metaloom.speculative.drafters.ngram_tree`)
and speculator heads' top-k per head, Medusa's trees (`metaloom.speculative.drafters.heads_tree`).
Exact trees on hand-made contexts and toy heads with known probabilities, the flags and shapes
refused by name, and greedy speculative generation with each against plain greedy on the tiny
model of tests/test_token_tree.py, batch > 1."""

import math

import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.generator.local import LocalGenerator
from metaloom.generator.types import Request
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.drafter import Draft, Verified
from metaloom.speculative.drafters.heads import HeadsState
from metaloom.speculative.drafters.heads_tree import HeadsTreeDrafter, HeadsTreeState, last_kept, medusa_dynamic, medusa_static
from metaloom.speculative.drafters.ngram_tree import NgramTreeDrafter, build_trie
from metaloom.speculative.heads.model import HeadsConfig, SpeculatorHeads
from metaloom.speculative.tree import DraftTree, TreeShape
from metaloom.testing.tiny import tiny_llama

# --- n-gram continuations as a trie -----------------------------------------------------------

# The suffix (1, 2) occurred four times before; what followed each (3 tokens):
#   e=2: 5 6 7    e=8: 5 6 8    e=14: 3 4 9    e=19: 5 9 0
# merged:  5 (3 times, latest e=19) -> 6 (2, e=8) -> 8 (1, e=8)
#                                               -> 7 (1, e=2)
#                                   -> 9 (1, e=19) -> 0
#          3 (1, e=14) -> 4 -> 9
CONTEXT = [1, 2, 5, 6, 7, 9, 1, 2, 5, 6, 8, 9, 1, 2, 3, 4, 9, 1, 2, 5, 9, 0, 1, 2]


def _ngram_tree(shape: str, context=CONTEXT, budget=16, max_ngram=2) -> DraftTree:
    drafter = NgramTreeDrafter(TreeShape.parse(shape), max_ngram=max_ngram)
    state = drafter.start(None, None, [context], [None])  # type: ignore[arg-type]  # the n-gram drafter reads neither
    return state.propose([context], [budget], Ledger()).tree(0)


def test_the_trie_merges_shared_prefixes_and_counts_occurrences():
    root = build_trie([(2, (5, 6, 7)), (8, (5, 6, 8)), (14, (3, 4, 9)), (19, (5, 9, 0))])
    five = root.children[5]
    assert sorted(root.children) == [3, 5] and (five.count, five.last) == (3, 19)
    assert [(n.token, n.count, n.last) for n in five.ranked()] == [(6, 2, 8), (9, 1, 19)]
    assert [n.token for n in five.children[6].ranked()] == [8, 7]  # one occurrence each: the most recent first


def test_ngram_static_tree_takes_the_most_frequent_continuations_per_level():
    tree = _ngram_tree("static:2,2,1")
    # depth 1: 5 (3 occurrences), 3 (1); under 5: 6 (2), 9 (1); under 3: 4; one child each below
    assert tree.tokens == (5, 3, 6, 9, 4, 8, 0, 9)
    assert tree.parents == (-1, -1, 0, 0, 1, 2, 3, 4)
    tree = _ngram_tree("static:1,2,2")
    assert tree.tokens == (5, 6, 9, 8, 7, 0) and tree.parents == (-1, 0, 0, 1, 1, 2)
    # the chain shape follows the most frequent branch (not, as the chain drafter, one occurrence)
    assert _ngram_tree("static:1,1,1").tokens == (5, 6, 8)


def test_ngram_trees_are_cut_to_the_steps_node_budget_breadth_first():
    tree = _ngram_tree("static:2,2,1", budget=4)
    assert tree.tokens == (5, 3, 6, 9) and tree.parents == (-1, -1, 0, 0)
    assert len(_ngram_tree("static:2,2,1", budget=0)) == 0


def test_ngram_dynamic_tree_keeps_the_most_frequent_nodes():
    # best first: 5 (3), 6 (2), then nodes with one occurrence, the latest first: the branch of
    # e=19 (9 0, and as the tree is as deep as its budget, on to the end of the context: 1 2),
    # then e=14's (3 4 ...), then e=8's (8 ...)
    tree = _ngram_tree("dynamic:4")
    assert tree.tokens == (5, 6, 9, 0) and tree.parents == (-1, 0, 0, 2)
    tree = _ngram_tree("dynamic:8")
    assert tree.tokens == (5, 6, 9, 0, 1, 2, 3, 4) and tree.parents == (-1, 0, 0, 2, 3, 4, -1, 6)
    assert _ngram_tree("dynamic:8", budget=3).tokens == (5, 6, 9)  # the step's budget is smaller


def test_ngram_tree_uses_the_longest_matching_suffix():
    # with trigrams, only the occurrences of (9, 1, 2) count: e=14 (3 4 9) and e=19 (5 9 0);
    # the context now ends 9 1 2, so the one at e=19 is the latest
    context = [*CONTEXT[:-3], 9, 1, 2]
    assert _ngram_tree("static:2,1", context, max_ngram=3).tokens == (5, 3, 9, 4)
    # with bigrams only, (1, 2) has its four occurrences again (the last now followed by 5 9 9)
    assert _ngram_tree("static:2,1", context, max_ngram=2).tokens == (5, 3, 6, 4)
    assert len(_ngram_tree("static:2", [4, 5, 6])) == 0  # nothing occurred before: no draft


# --- speculator heads' top-k, Medusa's trees ---------------------------------------------------

# three heads' candidates (target token id, probability), best first
LEVELS = [[(10, 0.6), (11, 0.3), (12, 0.1)],
          [(20, 0.9), (21, 0.05), (22, 0.05)],
          [(30, 0.55), (31, 0.35), (32, 0.1)]]


def test_medusa_static_tree_is_the_cartesian_product_of_each_heads_top_k():
    tree = medusa_static(LEVELS, (2, 2, 1), 64)
    assert tree.tokens == (10, 11, 20, 21, 20, 21, 30, 30, 30, 30)
    assert tree.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert [tree.tokens[c] for c in tree.children(1)] == [20, 21]  # head 1's candidates under every depth-1 node
    assert medusa_static(LEVELS, (2, 2, 1), 5).tokens == (10, 11, 20, 21, 20)


def test_medusa_dynamic_tree_keeps_the_highest_path_products():
    # path products: 10 .6, 10-20 .54, 11 .3, 10-20-30 .297, 11-20 .27, 10-20-31 .189, 11-20-30 .1485, 12 .1, ...
    tree = medusa_dynamic(LEVELS, 7)
    paths = [tuple(tree.tokens[i] for i in tree.path(n)) for n in range(len(tree))]
    assert paths == [(10,), (10, 20), (11,), (10, 20, 30), (11, 20), (10, 20, 31), (11, 20, 30)]
    products = [math.prod(dict(lv)[t] for lv, t in zip(LEVELS, p, strict=False)) for p in paths]
    assert products == sorted(products, reverse=True)
    assert medusa_dynamic(LEVELS, 2).tokens == (10, 20)


def _toy_heads(probs: list[list[float]], vocab_ids: list[int]) -> SpeculatorHeads:
    """Heads whose stage i gives ``probs[i]`` over the draft vocabulary whatever they read: each
    stage's LayerNorm has weight 0, so its state is GELU(bias) = GELU(1) for any input, and its
    output layer scales that to the log-probabilities (the LM head rows are the identity)."""
    n = len(probs[0])
    heads = SpeculatorHeads(HeadsConfig(stages=len(probs), hidden_size=n, inner_size=n, vocab_size=64, draft_vocab=n),
                            torch.tensor(vocab_ids))
    with torch.no_grad():
        for i, p in enumerate(probs):
            heads.norm[i].weight.zero_()
            heads.norm[i].bias.fill_(1.0)
            heads.out[i].weight.copy_(torch.diag(torch.tensor(p).log() / torch.nn.functional.gelu(torch.tensor(1.0))))
    return heads


def _toy_state(shape: str, probs=None) -> HeadsTreeState:
    probs = probs or [[0.05, 0.6, 0.05, 0.3], [0.1, 0.1, 0.1, 0.7], [0.35, 0.05, 0.55, 0.05]]
    heads = _toy_heads(probs, [40, 41, 42, 43])  # draft vocabulary row j is target token 40 + j
    n = len(probs[0])
    base = HeadsState(heads, torch.randn(64, n), torch.eye(n), torch.zeros(2, n))
    return HeadsTreeState(base, TreeShape.parse(shape))


def test_heads_tree_puts_head_is_top_k_at_depth_i():
    state = _toy_state("static:2,1,2")
    draft = state.propose([[1, 2, 3], [4, 5]], [64, 64], Ledger())
    for b in range(2):
        tree = draft.tree(b)
        # head 0: 41 (.6), 43 (.3); head 1: 43 (.7) under each; head 2: 42 (.55), 40 (.35) under each
        assert tree.tokens == (41, 43, 43, 43, 42, 40, 42, 40)
        assert tree.parents == (-1, -1, 0, 1, 2, 2, 3, 3)
    dynamic = _toy_state("dynamic:4").propose([[1]], [64], Ledger()).tree(0)
    # 41 .6, 41-43 .42, 43 .3, 41-43-42 .231 (before 43-43 .21)
    assert [tuple(dynamic.tokens[i] for i in dynamic.path(n)) for n in range(4)] == [
        (41,), (41, 43), (43,), (41, 43, 42)]
    assert len(state.propose([[1], [2]], [3, 0], Ledger()).tree(1)) == 0  # a row with no budget drafts nothing
    assert len(state.propose([[1], [2]], [3, 0], Ledger()).tree(0)) == 3


def test_heads_tree_drafts_nothing_before_the_first_hidden_state_and_for_rows_that_joined():
    loaded = tiny_llama()
    drafter = HeadsTreeDrafter(TreeShape((2,)), heads=_random_heads())
    running = drafter.start(loaded.model, None, [[1], [2]], [None, None])  # type: ignore[arg-type]
    assert running.propose([[1], [2]], [4, 4], Ledger()).lengths.tolist() == [0, 0]  # after the prefill
    running.base.hidden, running.base.known = torch.randn(2, 32), None  # as after a verify step
    joined = running.join(drafter.start(loaded.model, None, [[3], [4]], [None, None]))  # type: ignore[arg-type]
    assert joined.propose([[1], [2], [3], [4]], [4] * 4, Ledger()).lengths.tolist() == [2, 2, 0, 0]
    assert joined.select([3, 0]).propose([[4], [1]], [4, 4], Ledger()).lengths.tolist() == [0, 2]
    running.base.hidden = None  # a loop that reports no hidden states
    assert running.propose([[1], [2]], [4, 4], Ledger()).lengths.tolist() == [0, 0]


def test_heads_read_the_hidden_state_of_the_accepted_paths_last_node():
    #   root -> 0 (a=5) -> 2 (c=7)
    #        -> 1 (b=6) -> 3 (d=8)
    draft = Draft.from_trees([DraftTree((5, 6, 7, 8), (-1, -1, 0, 1))] * 3)
    emitted = torch.tensor([[6, 8, 1, 0, 0], [9, 0, 0, 0, 0], [5, 7, 2, 0, 0]])  # paths b-d, none, a-c
    hidden = torch.arange(3 * 5, dtype=torch.float32).view(3, 5, 1).expand(3, 5, 4)
    verified = Verified(draft=draft, logits=torch.zeros(3, 5, 8), accepted=torch.tensor([2, 0, 2]), tokens=emitted,
                        hidden=hidden)
    assert last_kept(verified) == [4, 0, 3]  # block positions: node 3, the root, node 2
    state = _toy_state("static:2")
    state.observe(verified)
    assert state.base.hidden is not None and state.base.hidden[:, 0].tolist() == [4.0, 5.0, 13.0]


def test_shapes_the_drafters_cannot_hold_are_refused_by_name():
    with pytest.raises(InvalidParameter, match="tree"):
        TreeShape.parse("static:2,0")  # a zero width, the same check as every tree drafter's
    for make in (NgramTreeDrafter, HeadsTreeDrafter):
        with pytest.raises(InvalidParameter, match="tree"):
            make(TreeShape((65, 1)))  # wider than a verify forward can take
        with pytest.raises(InvalidParameter, match="tree"):
            make(TreeShape(nodes=65))
    loaded = tiny_llama()
    heads = _random_heads(stages=2)
    sampler = None
    with pytest.raises(InvalidParameter, match="tree"):  # three levels, two heads
        HeadsTreeDrafter(TreeShape((2, 2, 2)), heads=heads).start(loaded.model, sampler, [[1]], [None])  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="tree"):  # wider than the heads' draft vocabulary (26)
        HeadsTreeDrafter(TreeShape((27,)), heads=heads).start(loaded.model, sampler, [[1]], [None])  # type: ignore[arg-type]


def test_ngram_and_heads_take_tree_flags_and_build_tree_drafters():
    import argparse

    from metaloom.commands.speculative import add_speculative_args, check_speculative_args
    from metaloom.speculative.drafters.heads import HeadsDrafter
    from metaloom.speculative.drafters.ngram import NgramDrafter
    from metaloom.speculative.registry import TREE_DRAFTERS, DrafterOptions, build_drafter

    p = argparse.ArgumentParser()
    add_speculative_args(p)
    for name in ("ngram", "heads"):
        assert name in TREE_DRAFTERS
        for tree in ("static:3,2", "dynamic:8"):
            check_speculative_args(p.parse_args(["--speculative", name, "--tree", tree]))
        with pytest.raises(InvalidParameter) as err:
            check_speculative_args(p.parse_args(["--speculative", name, "--tree", "static:0"]))
        assert err.value.name == "tree"
    loaded = tiny_llama()
    tree = build_drafter("ngram", loaded, DrafterOptions(tree="dynamic:8", max_ngram=4))
    assert isinstance(tree, NgramTreeDrafter) and tree.shape == TreeShape(nodes=8) and tree.max_ngram == 4
    assert isinstance(build_drafter("heads", loaded, DrafterOptions(tree="static:4,2")), HeadsTreeDrafter)
    # without --tree, the chain drafters as before
    assert type(build_drafter("ngram", loaded, DrafterOptions())) is NgramDrafter
    assert type(build_drafter("heads", loaded, DrafterOptions())) is HeadsDrafter


# --- end to end: greedy speculative generation equals plain greedy -----------------------------

PROMPTS = ["abcabc", "hello", "zzzyx", "thecatsatonthemat"]
LENGTHS = [40, 25, 33, 40]  # rows finish at different steps (the batch drops them)


def _random_heads(stages=3, seed=0) -> SpeculatorHeads:
    """Untrained heads for the tiny model (d 32, 26 tokens): their guesses are poor, which is
    why the trees below are wide."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        heads = SpeculatorHeads(HeadsConfig(stages=stages, hidden_size=32, inner_size=16, vocab_size=26,
                                            draft_vocab=26), torch.arange(26))
    return heads.eval()


class _Recording:
    """A drafter that passes everything through to ``inner`` and keeps every tree it proposed."""

    def __init__(self, inner):
        self.inner, self.trees = inner, []

    @property
    def name(self):
        return self.inner.name

    def start(self, target, sampler, contexts, keys):
        return _RecordingState(self, self.inner.start(target, sampler, contexts, keys))


class _RecordingState:
    def __init__(self, owner, inner):
        self.owner, self.inner = owner, inner
        self.needs_hidden = getattr(inner, "needs_hidden", False)

    def propose(self, contexts, limits, ledger):
        draft = self.inner.propose(contexts, limits, ledger)
        self.owner.trees += [draft.tree(b) for b in range(len(contexts))]
        return draft

    def observe(self, verified):
        self.inner.observe(verified)

    def select(self, rows):
        return _RecordingState(self.owner, self.inner.select(rows))

    def join(self, other):
        return _RecordingState(self.owner, self.inner.join(other.inner))


def _branching(trees) -> int:
    """How many of ``trees`` have a node (or the root) with two or more children."""
    return sum(any(len(t.children(n)) > 1 for n in range(-1, len(t))) for t in trees)


def _greedy_outputs(drafter=None, num_draft=12):
    loaded = tiny_llama()
    spec = None if drafter is None else Speculative(drafter, num_draft)
    ledger = Ledger()
    requests = [Request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for p, n in zip(PROMPTS, LENGTHS, strict=True)]
    out = LocalGenerator(loaded, speculative=spec).generate(requests, ledger=ledger)
    return [c[0].token_ids for c in out], ledger.usage


@pytest.fixture(scope="module")
def plain():
    return _greedy_outputs()[0]


@pytest.mark.parametrize("shape", ["static:3,2,1", "dynamic:10"])
def test_ngram_trees_give_plain_greedys_tokens_and_accept_drafts(plain, shape):
    drafter = _Recording(NgramTreeDrafter(TreeShape.parse(shape), max_ngram=3))
    got, usage = _greedy_outputs(drafter)
    assert got == plain
    assert usage.accepted_tokens > 0.5 * usage.verify_steps  # the repetitive outputs are drafted from the context
    assert _branching(drafter.trees) > 5  # several continuations at once: trees, not one occurrence's chain


@pytest.mark.parametrize("shape", ["static:8,2", "dynamic:16"])
def test_heads_trees_give_plain_greedys_tokens_and_accept_drafts(plain, shape):
    drafter = _Recording(HeadsTreeDrafter(TreeShape.parse(shape), heads=_random_heads()))
    got, usage = _greedy_outputs(drafter, num_draft=24)
    assert got == plain
    assert usage.accepted_tokens > 0  # the heads read the tree step's hidden states (else they draft nothing)
    assert _branching(drafter.trees) > 50


def test_the_heads_chain_keeps_rows_that_join_before_their_first_hidden_state():
    """Continuous batching: a state started for rows that join a running batch has no hidden
    state yet; joining keeps its rows (they draft nothing until their first verification)."""
    from metaloom.speculative.drafters.heads import HeadsDrafter

    loaded = tiny_llama()
    drafter = HeadsDrafter(heads=_random_heads(), min_prob=0.0)
    running = drafter.start(loaded.model, None, [[1], [2]], [None, None])  # type: ignore[arg-type]
    running.hidden = torch.randn(2, 32)  # as after a verify step
    joined = running.join(drafter.start(loaded.model, None, [[3], [4], [5]], [None, None, None]))  # type: ignore[arg-type]
    assert joined.rows == 5
    assert joined.propose([[1], [2], [3], [4], [5]], [3] * 5, Ledger()).lengths.tolist() == [3, 3, 0, 0, 0]
    assert joined.select([4, 1]).propose([[5], [2]], [3, 3], Ledger()).lengths.tolist() == [0, 3]
    fresh = drafter.start(loaded.model, None, [[1]], [None]).join(  # type: ignore[arg-type]
        drafter.start(loaded.model, None, [[2], [3]], [None, None]))  # type: ignore[arg-type]
    assert fresh.rows == 3 and fresh.propose([[1], [2], [3]], [3] * 3, Ledger()).lengths.tolist() == [0, 0, 0]


def test_a_tree_without_num_draft_is_drafted_whole():
    import argparse

    from metaloom.commands.speculative import speculative_option
    from metaloom.speculative.registry import default_num_draft

    assert TreeShape.parse("static:4,2").size == 12 and TreeShape.parse("static:1,1,1").size == 3
    assert TreeShape.parse("dynamic:10").size == 10
    assert default_num_draft("heads") == 3 and default_num_draft("heads", "static:4,2") == 12
    assert default_num_draft("ngram", "static:8,8") == 64  # 72 nodes, capped at MAX_DRAFT
    args = argparse.Namespace(speculative="ngram", draft_model=None, num_draft=None, quant_bits=8, tree="static:3,2")
    assert speculative_option(args, tiny_llama()).num_draft == 9
    args.num_draft = 4  # asked for: kept (the tree is cut breadth-first to 4 nodes)
    assert speculative_option(args, tiny_llama()).num_draft == 4


def test_one_ngram_index_serves_the_chain_and_the_tree():
    """Every occurrence's end is kept (the tree merges them); the chain copies after the first
    (``occurrence="first"``) or the latest, of the longest suffix that occurred before."""
    from metaloom.speculative.drafters.ngram import NgramIndex

    context = [7, 1, 2, 7, 3, 4, 7, 5, 1, 7]  # the suffix "1 7" never occurred before; "7" did, then 1, 3 and 5
    for first, copy in ((True, [1, 2]), (False, [5, 1])):
        index = NgramIndex(first)
        index.update(context, range(1, 3))
        assert index.ends(context, range(1, 3)) == [1, 4, 7]
        assert index.lookup(context, range(1, 3), 2) == copy
    other = [*context[:-1], 2]  # its suffix "1 2" occurred at 1..3: the longer match wins over "2" alone
    index = NgramIndex()
    index.update(other, range(1, 3))
    assert index.ends(other, range(1, 3)) == [3]
