"""`select.verify` for greedy rows under the plain pipeline (log-softmax of the model's own
logits, no constraint, no state) on the CPU: the same acceptance, log-probabilities and
tokens, with the log-softmax taken only over the positions the acceptance reads.

A greedy row keeps its drafts while each equals the argmax of the pipeline's log-probabilities
at its position, and emits the argmax at the first position that differs: it reads positions
0 .. a (a the drafts it keeps), never the ones after. A verify of K drafts that keeps one of
them needs two positions' log-softmax, not K + 1: for prompt lookup's drafts of 10 on
SmolLM2, 11 rows of 49,152 logits, about 0.3 ms of a 10 ms step (AMD EPYC Zen 4, issue 47).

Which positions are read is found first from the raw logits' argmax (one C pass,
`draw.row_max`), which is the log-probabilities' argmax except where rounding makes two
log-probabilities of different logits equal. So the walk is then made again from the
log-probabilities themselves, and where it would read a position past those computed (such a
tie), or a position allows no token, the caller takes the general path instead.
"""

from __future__ import annotations

import torch

from metaloom.models.kernels import draw as c_draw
from metaloom.speculative.core import Acceptance, greedy_kept
from metaloom.speculative.drafter import Draft


def applies(scores: torch.Tensor, plain_greedy: bool) -> bool:
    """Whether ``scores`` [B, K+1, V] take `greedy_verify`: every row greedy under the plain
    pipeline (the caller knows), float32 on the CPU."""
    return plain_greedy and scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 3


def greedy_verify(scores: torch.Tensor, draft: Draft) -> tuple[Acceptance, torch.Tensor, torch.Tensor] | None:
    """(acceptance, log-probabilities [B, R, V] of the first R positions, the emitted tokens'
    log-probabilities [B, K+1] (padding past a row's emitted tokens)) for greedy rows, R the
    positions any row read; None where the general path must decide (module doc)."""
    b, k1, _ = scores.shape
    drafts, lengths = draft.tokens.tolist(), draft.lengths.tolist()
    guess = c_draw.row_max(scores)[1].tolist()  # the raw logits' argmax, [B][K+1]
    reach = max((greedy_kept(guess[r], drafts[r], lengths[r]) for r in range(b)), default=0) + 1
    lp = torch.log_softmax(scores[:, :reach], dim=-1)  # the plain pipeline's own arithmetic
    values, best = c_draw.row_max(lp)
    tops, own = values.tolist(), best.tolist()
    accepted, tokens, chosen = [], [], []
    for r in range(b):
        a = greedy_kept(own[r], drafts[r], min(lengths[r], reach - 1))
        if a == reach - 1 and a < lengths[r] and own[r][a] == drafts[r][a]:
            return None  # a tie the raw argmax broke otherwise: this row reads on past `reach`
        if not all(v > float("-inf") for v in tops[r][:a + 1]):
            return None  # a position allows no token (NaN or -inf logits): the general path says why
        row = [*drafts[r], 0]
        row[a] = own[r][a]
        accepted.append(a)
        tokens.append(row)
        chosen.append(tops[r][:a + 1] + [0.0] * (k1 - a - 1))
    acceptance = Acceptance(accepted=torch.tensor(accepted, dtype=torch.long),
                            tokens=torch.tensor(tokens, dtype=torch.long).view(b, k1))
    return acceptance, lp, torch.tensor(chosen, dtype=torch.float32).view(b, k1)
