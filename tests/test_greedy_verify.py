"""The greedy verify that takes the log-softmax of the positions read only
(`metaloom.decode.greedy_verify`) against `select.verify`'s general path: the same accepted
drafts, emitted tokens and log-probabilities, including where rounding ties two logits' log-
probabilities so that the raw argmax and the pipeline's differ."""

from __future__ import annotations

import pytest
import torch

from metaloom.decode import greedy_verify, select
from metaloom.sampling import SamplingParams, make_sampler
from metaloom.speculative.drafter import Draft

V = 300


def _both(scores: torch.Tensor, drafts: list[list[int]], monkeypatch: pytest.MonkeyPatch):
    sampler = make_sampler([SamplingParams(temperature=0)] * scores.shape[0], V)
    state = sampler.start()
    draft = Draft.from_lists(drafts)
    calls = []
    real = greedy_verify.greedy_verify

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(greedy_verify, "greedy_verify", counted)
    fast = select.verify(sampler, state, scores, draft, None, [None] * scores.shape[0])
    monkeypatch.setattr(greedy_verify, "applies", lambda *a: False)
    slow = select.verify(sampler, state, scores, draft, None, [None] * scores.shape[0])
    return fast, slow, calls


def _emitted(v: select.Verified) -> list[tuple[list[int], list[float]]]:
    acc = v.acceptance
    assert v.chosen is not None
    return [(acc.emitted(b), v.chosen[b, :int(acc.accepted[b]) + 1].tolist()) for b in range(acc.accepted.shape[0])]


@pytest.mark.parametrize("seed", range(6))
def test_the_positions_read_give_the_general_paths_acceptance_and_log_probabilities(seed, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    k = 5
    scores = torch.randn(3, k + 1, V, generator=g) * 3
    best = scores.argmax(-1)
    keep = [0, 2, k]  # row 0 rejects its first draft, row 1 keeps two, row 2 keeps all
    drafts = []
    for b, n in enumerate(keep):
        row = best[b, :k].tolist()
        if n < k:
            row[n] = (row[n] + 1) % V  # the first rejected draft
        drafts.append(row)
    drafts[0] = drafts[0][:3]  # rows of different lengths
    fast, slow, calls = _both(scores, drafts, monkeypatch)
    assert calls == [True]  # the fast path decided
    assert fast.acceptance.accepted.tolist() == slow.acceptance.accepted.tolist() == keep
    assert _emitted(fast) == _emitted(slow)
    reach = max(keep) + 1
    assert torch.equal(fast.logprobs, slow.logprobs[:, :reach])  # the positions read, bit for bit


def _tied() -> torch.Tensor:
    """One position whose log-probabilities tie two different logits: 1.0 at token 5 and the next
    float above it at token 7 (the raw argmax), equal after subtracting the log-sum-exp."""
    x = torch.zeros(1, 2, V)
    x[0, 0, 5] = 1.0
    x[0, 0, 7] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    lp = torch.log_softmax(x[0, 0], -1)
    assert x[0, 0].argmax() == 7 and lp[5] == lp[7] and lp.argmax() == 5  # the tie the test needs
    return x


@pytest.mark.parametrize(("drafted", "kept", "fast_decides"), [(5, 1, False), (7, 0, True)])
def test_a_rounding_tie_between_raw_and_pipeline_argmax_gives_the_general_paths_answer(drafted, kept, fast_decides,
                                                                                      monkeypatch):
    # drafting 5 (the pipeline's argmax, not the raw one) is accepted: the raw walk stopped
    # before the position the pipeline's reads next, so the general path decides; drafting 7
    # (the raw argmax) is rejected for 5
    fast, slow, calls = _both(_tied(), [[drafted]], monkeypatch)
    assert calls == [fast_decides]
    assert fast.acceptance.accepted.tolist() == slow.acceptance.accepted.tolist() == [kept]
    assert _emitted(fast) == _emitted(slow)
    assert fast.acceptance.emitted(0)[0] == 5


def test_a_position_without_a_token_goes_to_the_general_path(monkeypatch):
    scores = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(0))
    scores[0, 0] = float("nan")
    fast, slow, calls = _both(scores, [[1, 2]], monkeypatch)
    assert calls == [False] and fast.errors and fast.errors == slow.errors
