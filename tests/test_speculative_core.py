"""Speculative sampling is exact: the acceptance rule emits plain sampling's own draws (the
inverse CDF at each position's counter uniform), so over many rows the tokens follow the
target's distribution for adversarial drafts (statistical bounds from n)."""

import numpy as np
import pytest
import torch

from metaloom.sampling import SamplingParams
from metaloom.sampling.counter import row_key
from metaloom.sampling.pipeline import make_sampler
from metaloom.speculative.core import accept, gather_states, plain_draws, target_logprobs
from metaloom.testing.stats import assert_samples_match

N = 12000


def _keys(n: int, seed: int = 0) -> np.ndarray:
    """n rows of distinct random keys, each at position 0 (`metaloom.sampling.counter`)."""
    return np.array([(row_key(seed, i), 0) for i in range(n)], dtype=np.int64)


def _log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p.float())


def _first_tokens(p: torch.Tensor, draft: torch.Tensor, n: int = N, seed: int = 0) -> torch.Tensor:
    """Emit one step for n identical rows whose single draft token is ``draft[b]``, and return the
    counts of the first emitted token."""
    v = p.shape[0]
    target = _log(p).expand(n, 2, v).clone()
    out = accept(target, draft[:, None], torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool),
                 _keys(n, seed))
    return torch.bincount(out.tokens[:, 0], minlength=v)


def _drawn(q: torch.Tensor, n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.multinomial(q.float(), n, replacement=True, generator=torch.Generator().manual_seed(seed))


PAIRS = {
    "p equals q": ([0.5, 0.3, 0.2, 0.0], [0.5, 0.3, 0.2, 0.0]),
    "disjoint supports": ([0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 0.7, 0.3]),
    "draft zero where target positive": ([0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.9, 0.1]),
    "draft overconfident": ([0.1, 0.2, 0.3, 0.4], [0.97, 0.01, 0.01, 0.01]),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_first_token_follows_the_target(name):
    p, q = (torch.tensor(x) for x in PAIRS[name])
    counts = _first_tokens(p, _drawn(q))
    assert_samples_match(counts, p)


@pytest.mark.parametrize("token", [0, 2, 3])
def test_one_hot_draft_follows_the_target(token):
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])  # token 3: the target never emits it
    counts = _first_tokens(p, torch.full((N,), token))
    assert_samples_match(counts, p)


def test_two_token_joint_follows_the_target():
    """K = 2 over a Markov target: the joint of the first two emitted tokens equals p(x1) p(x2|x1),
    finishing rows that stopped after one token with a plain draw (what the next step does)."""
    v, n = 4, N
    p0 = torch.tensor([0.4, 0.3, 0.2, 0.1])
    table = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 1.0]])
    q0 = torch.tensor([0.1, 0.1, 0.1, 0.7])
    q_table = torch.tensor([[0.0, 0.0, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.3, 0.3, 0.3, 0.1]])
    g = torch.Generator().manual_seed(3)
    d1 = torch.multinomial(q0, n, replacement=True, generator=g)
    d2 = torch.multinomial(q_table[d1], 1, generator=g)[:, 0]
    target = torch.stack([_log(p0).expand(n, v), _log(table[d1]), _log(table[d2])], dim=1)
    out = accept(target, torch.stack([d1, d2], 1), torch.full((n,), 2), torch.zeros(n, dtype=torch.bool), _keys(n, 3))
    first = out.tokens[:, 0]
    second = out.tokens[:, 1].clone()
    stopped = out.accepted == 0
    second[stopped] = torch.multinomial(table[first[stopped]], 1, generator=g)[:, 0]
    counts = torch.bincount(first * v + second, minlength=v * v)
    assert_samples_match(counts, (p0[:, None] * table).flatten())
    assert {0, 1, 2} <= set(out.accepted.tolist())  # rows of the batch kept different counts


def test_rows_of_one_batch_with_different_pairs_and_lengths():
    """One batch mixing rows: each row's first token follows its own target."""
    v, per = 4, 6000
    rows = [(torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.5, 0.5]), 1),
            (torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.1, 0.2, 0.3, 0.4]), 3),
            (torch.tensor([0.7, 0.1, 0.1, 0.1]), torch.tensor([0.25, 0.25, 0.25, 0.25]), 0)]
    g = torch.Generator().manual_seed(5)
    targets, drafts, lengths = [], [], []
    for p, q, k in rows:
        targets.append(_log(p).expand(per, 4, v))
        drafts.append(torch.multinomial(q, per * 3, replacement=True, generator=g).view(per, 3))
        lengths.append(torch.full((per,), k))
    out = accept(torch.cat(targets), torch.cat(drafts), torch.cat(lengths), torch.zeros(3 * per, dtype=torch.bool),
                 _keys(3 * per, 5))
    for i, (p, _, k) in enumerate(rows):
        block = slice(i * per, (i + 1) * per)
        assert_samples_match(torch.bincount(out.tokens[block, 0], minlength=v), p)
        assert int(out.accepted[block].max()) <= k


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    v = 5
    logits = torch.full((2, 4, v), -5.0)
    best = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])
    logits.scatter_(2, best[..., None], 5.0)
    drafts = torch.tensor([[1, 2, 0], [0, 0, 0]])
    out = accept(torch.log_softmax(logits, -1), drafts, torch.tensor([3, 2]), torch.tensor([True, True]), None)
    assert out.accepted.tolist() == [2, 2]
    assert out.emitted(0) == [1, 2, 3]  # two accepted, then the argmax replaces the wrong guess
    assert out.emitted(1) == [0, 0, 0]  # all accepted, then the bonus token


def test_target_logprobs_advance_the_pipeline_state_through_the_draft():
    """Presence penalty at position i sees the drafted tokens before i."""
    params = SamplingParams(temperature=1.0, presence_penalty=2.0)
    sampler = make_sampler([params], vocab_size=3)
    state = sampler.start([[0]])
    logits = torch.zeros(1, 3, 3)
    lp, states = target_logprobs(sampler, logits, torch.tensor([[1, 1]]), state, [None])
    assert torch.allclose(lp[0, 0].exp(), torch.full((3,), 1 / 3))
    penalised = torch.softmax(torch.tensor([0.0, -2.0, 0.0]), -1)
    assert torch.allclose(lp[0, 1].exp(), penalised) and torch.allclose(lp[0, 2].exp(), penalised)
    assert states[2].counts[0, 1] == 2
    picked = gather_states(states, torch.tensor([1]))
    assert picked.counts[0, 1] == 1


def test_gather_states_pads_growing_history():
    params = SamplingParams(temperature=1.0, no_repeat_ngram_size=2)
    sampler = make_sampler([params, params], vocab_size=4)
    state = sampler.start([[0, 1], [2]])
    _, states = target_logprobs(sampler, torch.zeros(2, 3, 4), torch.tensor([[3, 3], [1, 2]]), state, [None, None])
    picked = gather_states(states, torch.tensor([2, 0]))
    assert picked.lengths.tolist() == [4, 1]
    assert picked.history[0, :4].tolist() == [0, 1, 3, 3]
    assert picked.history[1, 0] == 2 and bool((picked.history[1, 1:] == -1).all())


def test_sampled_rows_emit_plain_samplings_draws_whatever_the_draft():
    """Row b emits, at each position, the inverse CDF of p there at its counter uniform: the
    token plain sampling draws, so a good draft only confirms more of them per forward."""
    v, n = 5, 64
    lp = torch.log_softmax(torch.randn(n, 4, v, generator=torch.Generator().manual_seed(2)), -1)
    keys = _keys(n, 9)
    plain = plain_draws(lp, keys)  # [n, 4]
    for drafts in (plain[:, :3], torch.zeros(n, 3, dtype=torch.long), (plain[:, :3] + 1) % v):
        out = accept(lp, drafts, torch.full((n,), 3), torch.zeros(n, dtype=torch.bool), keys)
        for b in range(n):
            emitted = out.emitted(b)
            assert emitted == plain[b, :len(emitted)].tolist()
    assert out.accepted.max() == 0  # every draft wrong: one token a row
    perfect = accept(lp, plain[:, :3], torch.full((n,), 3), torch.zeros(n, dtype=torch.bool), keys)
    assert perfect.accepted.tolist() == [3] * n
    one = plain_draws(lp[:1, :1], keys[:1])  # the same row alone, and its first position alone
    assert int(one[0, 0]) == int(plain[0, 0])


def test_all_greedy_rows_are_walked_on_the_host_as_the_tensor_ops_walk_them():
    """Every row greedy on a CPU (no keys): `accept` walks the drafts on the host; with keys and
    every row greedy it takes the tensor ops' way. The two agree on every row, including drafts
    accepted whole, rejected at once, empty, and matching past their length."""
    g = torch.Generator().manual_seed(3)
    b, k, v = 64, 6, 5
    lp = torch.log_softmax(torch.randn(b, k + 1, v, generator=g), dim=-1)
    best = lp.argmax(dim=-1)
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.7, best[:, :k], (best[:, :k] + 1) % v)
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    greedy = torch.ones(b, dtype=torch.bool)
    host = accept(lp, drafts, lengths, greedy, None)
    tensors = accept(lp, drafts, lengths, greedy, _keys(b))
    assert torch.equal(host.accepted, tensors.accepted) and torch.equal(host.tokens, tensors.tokens)
    assert set(host.accepted.tolist()) >= {0, k} and host.tokens.dtype == torch.long
