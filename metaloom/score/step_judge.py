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
from metaloom.score.steps import asked_steps, regroup

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
        asked = asked_steps(partial_steps, last_only)
        texts = [fill(self.template, "template", prompt=question, previous="".join(partial_steps[i][:j]).strip() or "(none)",
                      step=partial_steps[i][j].strip()) for i, j in asked]
        probs = yes_probability(self.generator, texts, ledger=ledger, method=self.method, yes=self.yes, no=self.no)
        return regroup(probs, asked, len(partial_steps))
