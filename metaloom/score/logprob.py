"""The model's own confidence as a scorer: sequence log-probability of each candidate, from
`Completion.logprobs` (the raw model distribution, whatever temperature drew the sample)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.protocols import Prompt


@dataclass(frozen=True)
class SequenceLogprob:
    """``sum log p(y_t | y_<t, x)``, or its mean per token when ``normalize`` — raw sums favour
    short outputs (the length bias beam search is known for; Wu et al. 2016), the mean does not.
    A candidate without tokens scores ``-inf``."""

    normalize: bool = False
    name: str = "logprob"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        out = []
        for c in candidates:
            if not c.logprobs:
                out.append(float("-inf"))
            else:
                out.append(c.logprob / len(c.logprobs) if self.normalize else c.logprob)
        return out
