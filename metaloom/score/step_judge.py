"""An LLM as a step verifier: the judge model's P("Yes") that the latest step of a partial
solution is correct (the step-level form of LLM-as-judge, Zheng et al. 2023; used as a
generative PRM, e.g. Zhang et al. 2024, "Generative Verifiers"). It reads P(yes) through
`Generator.score` (``method="compare"``) or one greedy token (``method="sample"``), so it works
on the local engine and on a remote server alike (`metaloom.score.judge`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.score.judge import yes_probability
from metaloom.score.prompting import fill, user_text
from metaloom.score.protocols import Prompt

STEP_TEMPLATE = ("Problem:\n{prompt}\n\nSolution so far:\n{previous}\n\nNext step:\n{step}\n\n"
                 "Is the next step correct? Answer Yes or No.")


@dataclass(frozen=True)
class StepJudge:
    """Scores each step by the judge's P(yes) that it is correct given the steps before it.
    ``template`` fields: {prompt} (the question), {previous} (the steps so far, "(none)" for
    the first) and {step}. One scorer call per `score_steps`; the judge's generation is
    charged like any other."""

    generator: Generator
    method: str = "compare"
    template: str = STEP_TEMPLATE
    yes: str = "Yes"
    no: str = "No"
    name: str = "judge"

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        question = user_text(prompt)
        asked: list[str] = []
        shape: list[int] = []
        for steps in partial_steps:
            which = range(len(steps) - 1, len(steps)) if last_only else range(len(steps))
            shape.append(len(which))
            for j in which:
                previous = "".join(steps[:j]).strip() or "(none)"
                asked.append(fill(self.template, "template", prompt=question, previous=previous, step=steps[j].strip()))
        probs = yes_probability(self.generator, asked, ledger=ledger, method=self.method, yes=self.yes, no=self.no)
        out: list[list[float]] = []
        at = 0
        for size in shape:
            out.append(probs[at:at + size])
            at += size
        return out
