"""Refinement: generate, get feedback, revise — for up to ``rounds`` revisions, stopping as
soon as the feedback passes (Madaan et al. 2023, Self-Refine; extrinsic feedback such as
failing tests: Chen et al. 2024, Self-Debugging).

Feedback comes from any `metaloom.score.feedback.Feedback`: an extrinsic verifier (a scorer
with a threshold, a function returning failing test output) or, by default, a prompted
critique from the same generator (intrinsic — mixed results on reasoning, Huang et al. 2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metaloom.errors import BudgetExceeded, ScorerFailed
from metaloom.generator.types import Completion, Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, default_sampling, ensure, generate_one, guarded, reseed, stop_if_budget
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.feedback import CritiqueFeedback, Feedback, Verdict
from metaloom.score.prompting import fill
from metaloom.score.protocols import Prompt, as_chat

REVISE = "Feedback on your answer:\n{feedback}\n\nWrite an improved answer to the original question."


def revision_prompt(prompt: Prompt, answer: str, message: str, template: str) -> Prompt:
    """A chat continues the conversation (assistant answer, user feedback); a raw prompt gets
    the answer and the feedback appended as text."""
    ask = fill(template, "revise_template", feedback=message)
    if isinstance(prompt, str):
        return f"{prompt}{answer}\n\n{ask}\n\n"
    return (*prompt, {"role": "assistant", "content": answer}, {"role": "user", "content": ask})


def verdict(run: Run, feedback: Feedback, prompt: Prompt, candidate: Completion, round: int) -> Verdict:
    before = run.ledger.usage
    try:
        v = feedback(prompt, candidate, ledger=run.ledger)
    except (BudgetExceeded, ScorerFailed):
        raise
    except Exception as exc:
        raise ScorerFailed(getattr(feedback, "name", type(feedback).__name__), exc) from exc
    run.event("feedback", round=round, passed=v.passed, message=v.message, score=v.score, usage=run.spent_since(before))
    return v


@dataclass(frozen=True)
class Refine:
    """Generate, get feedback, revise — until the feedback passes or the rounds run out.

    ``feedback=None`` means a prompted critique by the generator being refined. The chosen
    output is the first answer that passes; if none does, the best-scored one (latest on
    ties). Scores: the verdict's score, else 1/0 for pass/fail."""

    feedback: Feedback | None = None
    rounds: int = 3
    revise_template: str = REVISE
    params: SamplingParams = field(default_factory=default_sampling)

    def __post_init__(self) -> None:
        """``rounds`` counts revisions: 0 is one answer and its feedback, no revision."""

        # called as feedback(prompt, candidate, ledger=...); a name is optional, as for MBR's utility
        ensure(self.feedback is None or (callable(self.feedback) and not isinstance(self.feedback, type)), "feedback",
               self.feedback, "None (a prompted critique) or a Feedback instance")
        ensure(isinstance(self.rounds, int) and not isinstance(self.rounds, bool) and self.rounds >= 0, "rounds",
               self.rounds, "an integer >= 0 (0: one answer and its feedback, no revision)")
        ensure(isinstance(self.revise_template, str), "revise_template", self.revise_template, "a template string")
        # fill raises InvalidParameter("revise_template", ...) for any field but {feedback}
        uses_feedback = (fill(self.revise_template, "revise_template", feedback="")
                         != fill(self.revise_template, "revise_template", feedback="x"))
        ensure(uses_feedback, "revise_template", self.revise_template, "a template using {feedback}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        feedback: Feedback = self.feedback if self.feedback is not None else CritiqueFeedback(generator)

        def body(run: Run) -> None:
            current = prompt
            for r in range(self.rounds + 1):
                c = generate_one(run, generator, current, reseed(self.params, r), "generate" if r == 0 else "revise", round=r)
                run.candidates.append(c)
                stop_if_budget(run, [c])
                v = verdict(run, feedback, prompt, c, r)
                run.scores.append(v.score if v.score is not None else float(v.passed))
                run.best_index = max(range(len(run.scores)), key=lambda i: (run.scores[i], i))
                if v.passed:
                    run.best_index = r
                    return
                current = revision_prompt(current, c.text, v.message, self.revise_template)

        return guarded(ledger, body)
