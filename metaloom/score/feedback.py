"""Feedback for refinement: a verdict (pass or not) and a message the model can act on.

Extrinsic feedback (a verifier, failing test output) adds information the model lacks and
is what makes refinement work; intrinsic, prompted critique has mixed results on reasoning
(Huang et al. 2024, "LLMs Cannot Self-Correct Reasoning Yet"; Madaan et al. 2023, Self-Refine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from metaloom.generator.types import Completion, Generator, Request
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.score.prompting import fill, user_text
from metaloom.score.protocols import Prompt, Scorer

CRITIQUE_TEMPLATE = ("{prompt}\n\nProposed answer:\n{candidate}\n\nReview the proposed answer step by step. "
                     "If it is fully correct, reply with exactly CORRECT. Otherwise explain the mistake.")


@dataclass(frozen=True)
class Verdict:
    passed: bool
    message: str
    score: float | None = None


@runtime_checkable
class Feedback(Protocol):
    @property
    def name(self) -> str: ...

    def __call__(self, prompt: Prompt, candidate: Completion, *, ledger: Ledger) -> Verdict:
        ...


@dataclass(frozen=True)
class ScorerFeedback:
    """Any scorer as a verifier: passes at ``score >= threshold``; the message reports the
    score (a scorer says how good, not what is wrong)."""

    scorer: Scorer
    threshold: float = 0.5
    name: str = "verifier"

    def __call__(self, prompt: Prompt, candidate: Completion, *, ledger: Ledger) -> Verdict:
        s = float(self.scorer.score(prompt, [candidate], ledger=ledger)[0])
        passed = s >= self.threshold
        return Verdict(passed, "The verifier accepted the answer." if passed else
                       f"A verifier rejected this answer (score {s:.3f} < {self.threshold}). Find and fix the mistake.", s)


@dataclass(frozen=True)
class FunctionFeedback:
    """``fn(question, candidate_text) -> (passed, message)``: e.g. run the code against tests
    and return the failing test output (see `metaloom.score.execution`)."""

    fn: Callable[[str, str], tuple[bool, str]]
    name: str = "function"

    def __call__(self, prompt: Prompt, candidate: Completion, *, ledger: Ledger) -> Verdict:
        ledger.charge(scorer_calls=1)
        passed, message = self.fn(user_text(prompt), candidate.text)
        return Verdict(bool(passed), str(message), 1.0 if passed else 0.0)


@dataclass(frozen=True)
class CritiqueFeedback:
    """A prompted critique from ``generator`` (the same model for intrinsic self-refinement):
    passes when the critique contains ``ok_marker``; otherwise the critique is the message."""

    generator: Generator
    template: str = CRITIQUE_TEMPLATE
    ok_marker: str = "CORRECT"
    max_tokens: int = 256
    name: str = "critique"

    def __call__(self, prompt: Prompt, candidate: Completion, *, ledger: Ledger) -> Verdict:
        ledger.charge(scorer_calls=1)
        asked = fill(self.template, "template", prompt=user_text(prompt), candidate=candidate.text)
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        out = self.generator.generate([Request.chat(asked, params)], ledger=ledger)[0][0]
        if out.finish_reason == "budget":
            ledger.check()  # the critique was cut short: stop on the budget rather than judge half a critique
        critique = out.text.strip()
        return Verdict(self.ok_marker in critique, critique)


@dataclass(frozen=True)
class ExecutionFeedback:
    """Extrinsic feedback from running the candidate's code against ``tests`` in the sandbox
    (`metaloom.score.execution`, one run per test): passes when all pass; the message shows
    each failing test and the end of its traceback; the score is the fraction passed."""

    tests: tuple[str, ...]
    prefix: str = ""
    name: str = "tests"

    def __call__(self, prompt: Prompt, candidate: Completion, *, ledger: Ledger) -> Verdict:
        from metaloom.score.execution import ExecutionScorer

        ledger.charge(scorer_calls=1)
        runs = ExecutionScorer(tests=tuple(self.tests), prefix=self.prefix, partial_credit=True).results(candidate.text)
        failing = [f"Test:\n{t}\nResult: {r.status}\n{r.failure}".rstrip()
                   for t, r in zip(self.tests, runs, strict=True) if not r.passed]
        score = 1.0 - len(failing) / len(runs)
        if not failing:
            return Verdict(True, "All tests passed.", score)
        return Verdict(False, f"{len(failing)} of {len(runs)} tests failed.\n\n" + "\n\n".join(failing), score)
