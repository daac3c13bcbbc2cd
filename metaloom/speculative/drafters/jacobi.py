"""Jacobi decoding: fixed-point iteration over a block of guessed tokens.

Santilli et al. 2023, "Accelerating transformer inference for translation via parallel
decoding"; Fu et al. 2024, "Break the sequential dependency of LLM inference using lookahead
decoding". Greedy decoding is the fixed point of ``y_i = argmax p(. | x, y_<i)`` for every
position of a block at once; Jacobi iteration feeds the whole block of guesses, takes the
argmax at every position as the next guesses, and stops once nothing changes. Every iteration
fixes at least the first unfinished token; guesses that already equal the model's prediction
given the (verified) tokens before them are kept as they are.

Here one iteration is one verification step: the guess block is the draft, the verification
forward computes the argmax at every position, the accepted prefix is the converged part, and
the target's predictions after the first wrong guess become the next block's guesses (shifted
past the token that fixed the mismatch). The block is topped up to K positions with a
guess that repeats the last known token (plain Jacobi, whose first guesses are arbitrary).
``fill="lookup"`` puts a copy of what followed the current suffix earlier in the context in
front of the Jacobi guesses when there is one (an n-gram pool, as lookahead decoding keeps;
its pool comes from the Jacobi trajectories, this one from the context). Greedy verification
makes the output exactly plain greedy's, whatever the guesses; sampled rows verify the guesses
as one-hot drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.models.forward import Ledgers
from metaloom.models.kernels import draw as c_draw
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import Draft, DraftState, Verified
from metaloom.speculative.drafters.ngram import NgramIndex

FILLS = ("repeat", "lookup")


@dataclass(frozen=True)
class JacobiDrafter:
    fill: str = "repeat"
    name: str = "jacobi"

    def __post_init__(self) -> None:
        if self.fill not in FILLS:
            raise InvalidParameter("fill", self.fill, f"one of {list(FILLS)}")

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> JacobiState:
        return JacobiState(self.fill, [[] for _ in contexts], [NgramIndex(first=True) for _ in contexts])


class JacobiState:
    def __init__(self, fill: str, guesses: list[list[int]], lookup: list[NgramIndex]) -> None:
        self.fill = fill
        self.guesses = guesses  # guesses[b]: the block after row b's pending token, from the last iteration
        self.lookup = lookup

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        drafts = []
        sizes = range(1, 4)
        for b, (context, limit) in enumerate(zip(contexts, limits, strict=True)):
            block = self.guesses[b][:limit]
            if self.fill == "lookup":  # a copy from the context, when there is one, beats stale guesses
                self.lookup[b].update(context, sizes)
                found = self.lookup[b].lookup(context, sizes, limit)
                if found:
                    block = found + block[len(found):]
            last = block[-1] if block else context[-1]
            drafts.append(block + [last] * (limit - len(block)))
        return Draft.from_lists(drafts)

    def observe(self, verified: Verified) -> None:
        if verified.logits.shape[1] == 1:  # a plain step: no guess was checked, so none follows, and the
            self.guesses = [[] for _ in range(verified.logits.shape[0])]  # argmax over the vocabulary would
            return  # go unused (0.08 ms of a 6 ms step on SmolLM2)
        predictions = c_draw.row_max(verified.logits)[1]  # [B, K+1]: the iteration's new guesses (argmax)
        for b in range(predictions.shape[0]):
            n, k = int(verified.accepted[b]), int(verified.draft.lengths[b])
            # positions n+1 .. k predicted the tokens after the wrong guess d_{n+1}: the next
            # block (the token at n, which replaced d_{n+1}, is emitted)
            self.guesses[b] = predictions[b, n + 1:k + 1].tolist()

    def select(self, rows: Sequence[int]) -> JacobiState:
        return JacobiState(self.fill, [self.guesses[r] for r in rows], [self.lookup[r] for r in rows])

    def join(self, other: DraftState) -> JacobiState:
        assert isinstance(other, JacobiState)
        return JacobiState(self.fill, self.guesses + other.guesses, self.lookup + other.lookup)
