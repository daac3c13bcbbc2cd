"""Token trees (issue 32's foundation, metaloom.speculative.tree): the tree's shape and attention
mask on hand-made trees, greedy acceptance, the exactness of sampled acceptance (chi-square of
the emitted tokens against the target distributions), the tree-masked verify forward against
each root-to-leaf path verified as a chain, and the accepted path kept in the slot table."""

import math

import numpy as np
import pytest
import torch

from metaloom.errors import InvalidParameter
from metaloom.sampling.counter import row_key
from metaloom.speculative.tree import DraftTree, accept_greedy, accept_sampled, attention_mask
from metaloom.testing.tiny import tiny_llama

#   root -> 0 (a) -> 2 (c) -> 4 (e)
#        -> 1 (b) -> 3 (d)
#                 -> 5 (f)
TREE = DraftTree(tokens=(0, 1, 2, 3, 4, 5), parents=(-1, -1, 0, 1, 2, 1))


def test_tree_shape_and_mask_on_a_hand_made_tree():
    assert TREE.depths() == [1, 1, 2, 2, 3, 2]
    assert TREE.children(-1) == [0, 1] and TREE.children(1) == [3, 5]
    assert TREE.path(4) == [0, 2, 4] and TREE.path(-1) == []
    mask = attention_mask(TREE).int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0, 0],  # root
                    [1, 1, 0, 0, 0, 0, 0],  # node 0
                    [1, 0, 1, 0, 0, 0, 0],  # node 1
                    [1, 1, 0, 1, 0, 0, 0],  # node 2: root, 0, itself
                    [1, 0, 1, 0, 1, 0, 0],  # node 3: root, 1
                    [1, 1, 0, 1, 0, 1, 0],  # node 4: root, 0, 2
                    [1, 0, 1, 0, 0, 0, 1]]  # node 5: root, 1
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == (-1, 0, 1) and attention_mask(chain).equal(torch.ones(4, 4).tril().bool())


def test_bad_trees_are_refused_by_name():
    with pytest.raises(InvalidParameter, match="parents"):
        DraftTree((1, 2), (-1, 1))  # a node its own parent
    with pytest.raises(InvalidParameter, match="parents"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(InvalidParameter, match="tokens"):
        DraftTree((4, 4), (-1, -1))  # two siblings proposing one token


def test_greedy_acceptance_follows_the_targets_argmax_down_the_tree():
    # block positions: 0 root, 1 + i node i; the target wants b after the root, then f, then 9
    argmax = [1, 0, 5, 0, 0, 0, 9]
    got = accept_greedy(TREE, argmax)
    assert got.path == (1, 5) and got.tokens == (1, 5, 9)
    assert accept_greedy(TREE, [7, 0, 0, 0, 0, 0, 0]).tokens == (7,)  # the first choice is no child
    assert accept_greedy(TREE, [0, 2, 0, 4, 0, 3, 0]).tokens == (0, 2, 4, 3)  # the whole a-c-e branch and a bonus


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = n * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_acceptance_emits_exactly_the_target_distribution():
    """20,000 steps over a two-level tree: the first emitted token follows p_root (chi-square,
    5 degrees of freedom: 25.7 is its 1e-4 quantile), and after an accepted node the next token
    follows that node's p. A walk that drew the token after an accepted node at the uniform of
    the node's own position (not the next one) ties the two draws and fails this (tested)."""
    v = 6
    probs = torch.tensor([[0.30, 0.25, 0.05, 0.15, 0.10, 0.15],  # after the root
                          [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],  # after node 0 (a)
                          [0.05, 0.05, 0.05, 0.60, 0.05, 0.20],  # after node 1 (b)
                          *[[1 / v] * v] * 4])
    n = 20000
    first = np.zeros(v)
    after = {0: np.zeros(v), 1: np.zeros(v)}
    for i in range(n):
        out = accept_sampled(TREE, probs, row_key(0, i), 0)
        first[out.tokens[0]] += 1
        if out.path and len(out.tokens) > 1 and out.path[0] in after:
            after[out.path[0]][out.tokens[1]] += 1
    bound = 25.7  # chi-square, 5 degrees of freedom, 1 - 1e-4
    assert _chi2(first, probs[0].numpy()) < bound
    for node, counts in after.items():
        assert counts.sum() > 1000
        assert _chi2(counts, probs[node + 1].numpy()) < bound


def test_sampled_acceptance_emits_plain_samplings_draws():
    """Each emitted token is the inverse CDF of its position's p at the row's uniform for it."""
    from metaloom.sampling.counter import inverse_cdf, uniforms

    probs = torch.softmax(torch.randn(7, 6, generator=torch.Generator().manual_seed(3)), -1)
    for i in range(200):
        key = row_key(5, i)
        out = accept_sampled(TREE, probs, key, 40)
        at = [0, *(p + 1 for p in out.path)]  # block positions of the emitted tokens
        u = torch.from_numpy(uniforms(np.full(len(at), key), np.arange(40, 40 + len(at))))
        assert list(out.tokens) == inverse_cdf(probs[at].log(), u).tolist()


def test_sampled_acceptance_accepts_a_candidate_with_all_the_mass():
    probs = torch.zeros(7, 6)
    probs[0, 1] = 1.0  # the target is sure of b after the root
    probs[2, 3] = 1.0  # and of d after b
    probs[4:, 0] = 1.0
    for seed in range(20):
        assert accept_sampled(TREE, probs, row_key(seed, 0), 7).tokens == (1, 3, 0)


def _verify(model, cache, tokens, tree=None):
    return model.forward(torch.tensor([tokens]), cache, tree=tree)[0]


def test_a_tree_verified_in_one_forward_equals_each_path_verified_as_a_chain():
    model = tiny_llama().model
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    pending = 7
    cache = model.new_cache(1, 64)
    model.forward(torch.tensor([prompt]), cache)
    tokens = [pending, *(t + 10 for t in TREE.tokens)]
    logits = _verify(model, cache.fork([0]), tokens, attention_mask(TREE)[None])  # [7, V]
    for leaf in (4, 3, 5):
        path = TREE.path(leaf)
        chain = cache.fork([0])
        ref = _verify(model, chain, [pending, *(TREE.tokens[i] + 10 for i in path)])
        assert (logits[0] - ref[0]).abs().max().item() < 1e-5
        for at, node in enumerate(path):
            assert (logits[node + 1] - ref[at + 1]).abs().max().item() < 1e-5, (leaf, node)
        chain.release()


@pytest.mark.parametrize("fused", [False, True])
def test_the_accepted_path_is_kept_where_it_was_written_and_decoding_goes_on(fused):
    """After a tree verify, keeping the root and the accepted path (entries moved up in the
    table, no KV copied) leaves the cache a plain chain verify of that path would: the next
    step's logits equal, and the rejected branches' slots are free."""
    model = tiny_llama().model
    if fused:  # the next one-token step through the fused kernels, reading the moved table
        from metaloom.models.kernels.fused import kernels
        from tests.test_fused import _tiny

        if kernels().kernels is None:
            pytest.skip(kernels().reason)
        model = _tiny().with_fused(kernels().kernels)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    tokens = [7, *(t + 10 for t in TREE.tokens)]
    tree_cache, chain_cache = model.new_cache(1, 64), model.new_cache(1, 64)
    for c in (tree_cache, chain_cache):
        model.forward(torch.tensor([prompt]), c)
    start = len(prompt)
    model.forward(torch.tensor([tokens]), tree_cache, tree=attention_mask(TREE)[None])
    written = tree_cache.slots[0, start:start + 7].copy()
    path = TREE.path(5)  # b, f
    keep = np.array([*range(start + 1), *(start + 1 + i for i in path)])
    used = tree_cache.pool.used_slots
    assert tree_cache.keep_entries(0, keep) == 4
    assert tree_cache.pool.used_slots == used - 4
    assert tree_cache.slots[0, start:start + 3].tolist() == [written[0], written[2], written[6]]  # where written
    model.forward(torch.tensor([[7, *(TREE.tokens[i] + 10 for i in path)]]), chain_cache)
    a = model.forward(torch.tensor([[20]]), tree_cache)[0, -1]
    b = model.forward(torch.tensor([[20]]), chain_cache)[0, -1]
    assert (a - b).abs().max().item() < 1e-5
    assert not math.isnan(float(a.sum()))


def test_a_tree_mask_of_the_wrong_shape_is_refused_by_name():
    model = tiny_llama().model
    cache = model.new_cache(1, 16)
    with pytest.raises(InvalidParameter, match="tree"):
        model.forward(torch.tensor([[1, 2, 3]]), cache, tree=torch.ones(1, 2, 2, dtype=torch.bool))


# --- through the decode loop, with Token Recycling -------------------------------------------

def _generator(tree: str = "static:4,2,2,1"):
    from metaloom.generator.local import LocalGenerator
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    drafter = RecyclingDrafter(TreeShape.parse(tree))
    return LocalGenerator(tiny_llama(), speculative=Speculative(drafter, 12)), drafter


def test_recycling_trees_give_plain_greedys_tokens_and_accept_drafts():
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = ["abcabc", "hello", "zzzyx"]
    plain = LocalGenerator(tiny_llama()).generate([Request(p, params) for p in prompts], ledger=Ledger())
    gen, drafter = _generator()
    ledger = Ledger()
    for _ in range(2):  # the second time round the matrix knows these texts
        got = gen.generate([Request(p, params) for p in prompts], ledger=ledger)
        assert [c[0].token_ids for c in got] == [c[0].token_ids for c in plain]
    usage = ledger.usage
    assert usage.accepted_tokens > 0 and usage.verify_steps > 0
    assert usage.output_tokens == 2 * 3 * 30
    assert usage.verify_steps < usage.output_tokens  # some steps emitted more than one token
    assert int((drafter.table >= 0).any(-1).sum()) > 5  # it learned candidates for the tokens it read


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_tree_that_is_one_path_a_row_takes_the_chain_step(monkeypatch, temperature):
    """Token Recycling's chain shape is a tree whose nodes each follow the one before: it is
    verified by the chain step (no tree masks, walks or slot keeping), with plain decoding's
    tokens, greedy and sampled; a tree with siblings still takes the tree step."""
    import metaloom.decode.speculative_step as step
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    calls = []
    tree_step = step.tree_step
    monkeypatch.setattr(step, "tree_step", lambda *a, **k: calls.append(1) or tree_step(*a, **k))
    params = SamplingParams(temperature=temperature, max_tokens=30, ignore_eos=True, seed=7)
    prompts = ["abcabc", "hello", "zzzyx"]
    plain = LocalGenerator(tiny_llama()).generate([Request(p, params) for p in prompts], ledger=Ledger())
    for tree, through_tree in (("static:1,1,1,1", False), ("static:4,2,2,1", True)):
        gen, _ = _generator(tree)
        ledger = Ledger()
        calls.clear()
        for _ in range(2):  # the second time round the matrix knows these texts
            got = gen.generate([Request(p, params) for p in prompts], ledger=ledger)
            assert [c[0].token_ids for c in got] == [c[0].token_ids for c in plain]
        assert ledger.usage.verify_steps > 0 and ledger.usage.accepted_tokens > 0
        assert bool(calls) == through_tree, tree


def test_a_tree_counts_as_one_path_only_up_to_each_rows_limit():
    from metaloom.decode.speculative_step import _all_chains
    from metaloom.speculative.drafter import Draft

    # row 0: 5 -> 6, then 7 a sibling of 6; row 1: one node
    draft = Draft.from_trees([DraftTree((5, 6, 7), (-1, 0, 0)), DraftTree((9,), (-1,))])
    assert _all_chains(draft, [2, 1]) and _all_chains(draft, [2, 0])
    assert not _all_chains(draft, [3, 1])
    assert not _all_chains(Draft.from_trees([DraftTree((5, 6), (-1, -1))]), [2])  # two siblings


def test_recycling_samples_follow_plain_samplings_distribution_over_two_tokens():
    """600 samples of 4 tokens, the drafter warmed up on the prompt so its drafts (two sibling
    candidates for the second token) are often accepted: the (second, third) pairs against the
    model's own sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), by chi-square (cells with
    expected counts under 5 merged; bound: the 1e-4 quantile for the degrees of freedom, by the
    Wilson-Hilferty approximation). The first token comes from the prefill, not a tree."""
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    gen, _ = _generator("static:4,3")
    model = gen.model
    prompt = "abcab"
    warm = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=50, seed=1)
    gen.generate([Request(prompt, warm)], ledger=Ledger())
    n = 600
    ledger = Ledger()
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, n=n, seed=11)
    got = gen.generate([Request(prompt, params)], ledger=ledger)[0]
    assert ledger.usage.accepted_tokens > 100  # the trees did the work
    ids = gen.tokenizer.encode(prompt)
    v = model.vocab_size
    cache = model.new_cache(1, 16)

    def after(c, token):
        fork = c.fork([0])
        return fork, torch.softmax(model.forward(torch.tensor([[token]]), fork)[0, -1].double(), -1)

    first = torch.softmax(model.forward(torch.tensor([ids]), cache)[0, -1].double(), -1)
    joint = torch.zeros(v, v, dtype=torch.float64)
    for t1 in range(v):
        c1, second = after(cache, t1)
        for t2 in range(v):
            c2, third = after(c1, t2)
            joint[t2] += first[t1] * second[t2] * third
            c2.release()
        c1.release()
    counts = torch.zeros(v, v, dtype=torch.float64)
    for c in got:
        counts[c.token_ids[1], c.token_ids[2]] += 1
    expected = (joint * n).flatten()
    order = torch.argsort(expected, descending=True)
    e, o = expected[order], counts.flatten()[order]
    big = e >= 5
    e_cells = torch.cat([e[big], e[~big].sum()[None]])
    o_cells = torch.cat([o[big], o[~big].sum()[None]])
    chi2 = float(((o_cells - e_cells) ** 2 / e_cells).sum())
    df = len(e_cells) - 1
    z = 3.719  # the normal's 1 - 1e-4 quantile
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, (chi2, bound, df)


def test_tree_flags_are_checked_by_name():
    import argparse

    from metaloom.commands.speculative import add_speculative_args, check_speculative_args

    p = argparse.ArgumentParser()
    add_speculative_args(p)
    for argv, name in ((["--speculative", "jacobi", "--tree", "static:2,1"], "tree"),
                       (["--speculative", "recycling", "--tree", "static:2,0"], "tree"),
                       (["--speculative", "recycling", "--tree", "dynamic:x"], "tree"),
                       (["--speculative", "recycling", "--tree", "dynamic:8"], "tree"),
                       (["--tree", "static:2"], "speculative")):
        with pytest.raises(InvalidParameter) as err:
            check_speculative_args(p.parse_args(argv))
        assert err.value.name == name, argv
    check_speculative_args(p.parse_args(["--speculative", "recycling", "--tree", "static:4,2,1"]))


@pytest.mark.parametrize("tree", ["static:4,2,2,1", "static:1,1,1,1", "ngram"])
@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_tree_and_chain_steps_report_plain_decodings_log_probabilities(tree, penalty):
    """The emitted tokens' reported log-probabilities are the raw model's, as plain decoding's:
    with a plain pipeline they are read from the verify's own log-softmax, with a penalty (the
    pipeline's differ) from the raw logits."""
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=penalty)
    prompts = ["abcabc", "hello"]
    plain = LocalGenerator(tiny_llama()).generate([Request(p, params) for p in prompts], ledger=Ledger())
    if tree == "ngram":  # prompt lookup: the chain step
        from metaloom.speculative import Speculative
        from metaloom.speculative.drafters.ngram import NgramDrafter

        gen = LocalGenerator(tiny_llama(), speculative=Speculative(NgramDrafter(), 6))
    else:
        gen, _ = _generator(tree)
    ledger = Ledger()
    for _ in range(2):
        got = gen.generate([Request(p, params) for p in prompts], ledger=ledger)
    assert ledger.usage.accepted_tokens > 0
    for g, q in zip(got, plain, strict=True):
        assert g[0].token_ids == q[0].token_ids
        assert g[0].logprobs == pytest.approx(q[0].logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trees_under_a_constraint_and_penalties_on_the_default_model(smollm, temperature):
    """A regex constraint and a repetition penalty on the real model: every branch's cursor and
    penalty state is walked and rolled back, so greedy trees emit plain greedy's tokens and
    sampled trees still only emit text the constraint accepts."""
    import re

    from metaloom.constrain import ConstraintSpec
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    pattern = r" (the|a) [a-z]+( [a-z]+){2,6}\."
    params = SamplingParams(temperature=temperature, max_tokens=24, repetition_penalty=1.3, seed=5,
                            n=1 if temperature == 0 else 6)
    request = Request("Describe the sea in a few words:", params, constraint=ConstraintSpec.regex(pattern))
    drafter = RecyclingDrafter(TreeShape.parse("static:4,2,2,1"))
    tree = LocalGenerator(smollm, speculative=Speculative(drafter, 12))
    ledger = Ledger()
    outs = [tree.generate([request], ledger=ledger)[0] for _ in range(2)]  # the second with a warm matrix
    assert ledger.usage.accepted_tokens > 0
    for out in outs:
        for c in out:
            assert re.fullmatch(pattern, c.text), c.text
    if temperature == 0:
        plain = LocalGenerator(smollm).generate([request], ledger=Ledger())[0]
        assert [c.token_ids for c in outs[1]] == [c.token_ids for c in plain]


def test_each_node_is_scored_with_its_own_branchs_penalties():
    """With frequency and repetition penalties, the pipeline's distribution at every node of a
    tree equals the chain computation (`target_logprobs`) along that node's path."""
    from metaloom.decode.tree_verify import tree_logprobs
    from metaloom.sampling.params import SamplingParams
    from metaloom.sampling.pipeline import make_sampler
    from metaloom.speculative.core import target_logprobs
    from metaloom.speculative.drafter import Draft

    v = 12
    sampler = make_sampler([SamplingParams(temperature=1.0, frequency_penalty=0.7, repetition_penalty=1.4)], v)
    state = sampler.start([[1, 2]])
    scores = torch.randn(1, len(TREE) + 1, v, generator=torch.Generator().manual_seed(3))
    draft = Draft.from_trees([TREE])
    lp, _ = tree_logprobs(sampler, scores, draft, state, [None], None)
    for leaf in (4, 3, 5):
        path = TREE.path(leaf)
        block = scores[:, [0, *(i + 1 for i in path)]]
        chain, _ = target_logprobs(sampler, block, torch.tensor([[TREE.tokens[i] for i in path]]), state, [None])
        assert torch.allclose(lp[0, 0], chain[0, 0])
        for at, node in enumerate(path):
            assert torch.allclose(lp[0, node + 1], chain[0, at + 1]), (leaf, node)


@pytest.mark.parametrize("tree", ["static:3,2,1", "dynamic:10"])
def test_draft_model_trees_give_plain_greedys_tokens_and_accept_drafts(tree):
    """SpecInfer's top-k expansion and DySpec's best-first growth, the draft being the target
    requantised to Q8_0 (it agrees with the target most of the time)."""
    from metaloom.generator.local import LocalGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams
    from metaloom.speculative import Speculative
    from metaloom.speculative.drafters.draft_tree import draft_tree_drafter
    from metaloom.speculative.drafters.quantized import QuantizedLlama
    from metaloom.speculative.tree import TreeShape

    loaded = tiny_llama()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["abcabc", "hello", "zzzyx"]
    plain = LocalGenerator(loaded).generate([Request(p, params) for p in prompts], ledger=Ledger())
    drafter = draft_tree_drafter(QuantizedLlama(loaded.model, 8), TreeShape.parse(tree))
    ledger = Ledger()
    got = LocalGenerator(loaded, speculative=Speculative(drafter, 10)).generate([Request(p, params) for p in prompts],
                                                                              ledger=ledger)
    assert [c[0].token_ids for c in got] == [c[0].token_ids for c in plain]
    usage = ledger.usage
    assert usage.accepted_tokens / usage.verify_steps > 1.0  # more than one draft token kept a step
    assert usage.drafted_tokens > usage.verify_steps * 2  # trees, not single tokens


def test_recycling_learns_each_read_tokens_candidates_from_that_tokens_row_of_logits():
    """After a verify, M[x] holds the top-k of the logits row that followed each token x a row
    read: its pending token, then its drafted tokens up to its draft's length (not the padding)."""
    from metaloom.speculative.drafter import Draft, Verified
    from metaloom.speculative.drafters.recycling import CANDIDATES, RecyclingDrafter, RecyclingState

    vocab = 20
    drafter = RecyclingDrafter()
    drafter.table = torch.full((vocab, CANDIDATES), -1, dtype=torch.long)
    logits = torch.randn(2, 3, vocab, generator=torch.Generator().manual_seed(0))
    draft = Draft(torch.tensor([[7, 8], [9, 0]]), torch.tensor([2, 1]))  # row 1 drafted one token; 0 pads it
    RecyclingState(drafter).observe(Verified(draft=draft, logits=logits, accepted=torch.tensor([1, 0]),
                                             tokens=torch.tensor([[7, 3, 0], [2, 0, 0]]), hidden=None,
                                             pending=torch.tensor([4, 5])))
    top = logits.topk(CANDIDATES, dim=-1).indices
    for token, (b, i) in {4: (0, 0), 7: (0, 1), 8: (0, 2), 5: (1, 0), 9: (1, 1)}.items():
        assert drafter.table[token].tolist() == top[b, i].tolist(), token
    learned = {t for t in range(vocab) if drafter.table[t, 0] >= 0}
    assert learned == {4, 7, 8, 5, 9}  # the padding token read nothing


def test_a_token_recycling_reads_twice_keeps_the_candidates_of_its_last_reading():
    """A row that reads a token twice in one verify (pending 4, then drafted 4 again): M[4] holds
    the top-k of the logits after its second reading, as the paper's matrix is overwritten."""
    from metaloom.speculative.drafter import Draft, Verified
    from metaloom.speculative.drafters.recycling import CANDIDATES, RecyclingDrafter, RecyclingState

    vocab = 20
    drafter = RecyclingDrafter()
    drafter.table = torch.full((vocab, CANDIDATES), -1, dtype=torch.long)
    logits = torch.randn(1, 3, vocab, generator=torch.Generator().manual_seed(1))
    draft = Draft(torch.tensor([[4, 8]]), torch.tensor([2]))
    RecyclingState(drafter).observe(Verified(draft=draft, logits=logits, accepted=torch.tensor([2]),
                                             tokens=torch.tensor([[4, 8, 1]]), hidden=None, pending=torch.tensor([4])))
    top = logits.topk(CANDIDATES, dim=-1).indices
    assert top[0, 0].tolist() != top[0, 1].tolist()
    assert drafter.table[4].tolist() == top[0, 1].tolist() and drafter.table[8].tolist() == top[0, 2].tolist()


def test_a_fresh_recycling_matrix_proposes_nothing_without_growing_a_tree(monkeypatch):
    """Roots without candidates: the shared empty draft, no tree grown (its drafting is charged
    to the cost model's budget every step); a root with candidates grows its tree."""
    from metaloom.speculative.drafters.recycling import CANDIDATES, RecyclingDrafter, RecyclingState

    drafter = RecyclingDrafter()
    drafter.table = torch.full((20, CANDIDATES), -1, dtype=torch.long)
    state = RecyclingState(drafter)
    grown = []
    real_grow = drafter.grow
    monkeypatch.setattr(drafter, "grow", lambda root, budget: grown.append(root) or real_grow(root, budget))
    first = state.propose([[1, 2], [3]], [4, 4], None)
    assert first.lengths.tolist() == [0, 0] and state.propose([[5], [6]], [4, 4], None) is first and grown == []
    drafter.table[3, :2] = torch.tensor([7, 8])
    draft = state.propose([[1, 2], [3]], [4, 0], None)  # row 1 may not draft: its root is not grown
    assert draft.lengths.tolist() == [0, 0] and grown == []
    draft = state.propose([[1, 2], [3]], [4, 4], None)
    assert draft.lengths.tolist() == [0, 2] and draft.tokens[1].tolist() == [7, 8] and grown == [2, 3]


def test_a_tree_verify_needs_a_model_whose_forward_takes_the_tree_mask():
    from metaloom.errors import UnsupportedModel
    from metaloom.ledger import Ledger
    from metaloom.models.forward import charged_forward_both, takes_trees

    native = tiny_llama().model
    assert takes_trees(native)

    class NoTrees:  # a model whose forward has no ``tree``
        def forward(self, tokens, cache, valid=None, last_only=False):
            raise AssertionError("not reached")

    assert not takes_trees(NoTrees())
    with pytest.raises(UnsupportedModel, match="takes no token trees"):
        charged_forward_both(NoTrees(), torch.zeros(1, 2, dtype=torch.long), None, Ledger(),
                             tree=torch.ones(1, 2, 2, dtype=torch.bool))
