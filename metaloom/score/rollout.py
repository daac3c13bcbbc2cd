"""Monte-Carlo rollout value of a partial solution (Wang et al. 2024, "Math-Shepherd": a step's
quality is how often completions from it reach a correct answer; Luo et al. 2024 "OmegaPRM").

From each partial solution, ``k`` completions are sampled to the end (one generator call for
all partials). The value is the fraction of them that a ``verifier`` accepts (a final-answer
`Scorer` such as the countdown checker, accepted at score >= ``threshold``); without a
verifier, the fraction whose extracted answer agrees with the majority answer of all rollouts
in the call (the consensus standing in for the unknown reference). Completions continue the
rendered prompt plus the partial's text, so the scorer works with any generator that renders.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion, Generator, Request, render
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor, classes
from metaloom.score.protocols import Prompt, Scorer
from metaloom.score.steps import asked_steps, regroup


@dataclass(frozen=True)
class RolloutValue:
    """Monte-Carlo rollout value (Math-Shepherd): ``k`` rollouts per partial at ``temperature``,
    each up to ``max_tokens``; the fraction verified (or agreeing with the majority)."""

    generator: Generator
    k: int = 4
    verifier: Scorer | None = None
    extractor: Extractor | None = None
    threshold: float = 0.5
    temperature: float = 0.7
    max_tokens: int = 256
    seed: int | None = None
    name: str = "rollout"

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise InvalidParameter("k", self.k, "an integer >= 1 (rollouts per partial solution)")
        if self.verifier is None and self.extractor is None:
            raise InvalidParameter("verifier", None, "a final-answer Scorer (e.g. countdown), or an extractor to "
                                   "compare answers with the majority")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidParameter("max_tokens", self.max_tokens, "an integer >= 1")

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        asked = asked_steps(partial_steps, last_only)
        prefixes = ["".join(partial_steps[i][:j + 1]) for i, j in asked]
        if not prefixes:
            return [[] for _ in partial_steps]
        base = render(self.generator, prompt)
        params = SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, n=self.k, seed=self.seed)
        outs = self.generator.generate([Request(base + p, params) for p in prefixes], ledger=ledger)
        if any(c.finish_reason == "budget" for o in outs for c in o):
            ledger.check()
        full = [[Completion(p + c.text, c.token_ids, c.logprobs, c.finish_reason) for c in o]
                for p, o in zip(prefixes, outs, strict=True)]
        return regroup(self.values(prompt, full, ledger), asked, len(partial_steps))

    def values(self, prompt: Prompt, rollouts: list[list[Completion]], ledger: Ledger) -> list[float]:
        flat = [c for group in rollouts for c in group]
        if self.verifier is not None:
            scores = self.verifier.score(prompt, flat, ledger=ledger)
            ok = [s >= self.threshold for s in scores]
        else:
            assert self.extractor is not None
            ids = classes([self.extractor.extract(c.text) for c in flat], self.extractor)  # equal answers vote together
            votes = Counter(i for i in ids if i is not None)
            top = votes.most_common(1)[0][0] if votes else None
            ok = [i is not None and i == top for i in ids]
        out = []
        at = 0
        for group in rollouts:
            out.append(sum(ok[at:at + len(group)]) / len(group))
            at += len(group)
        return out
