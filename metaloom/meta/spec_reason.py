"""SpecReason: step-level speculative reasoning (Pan et al. 2025, "SpecReason: Fast and
Accurate Inference-Time Compute via Speculative Reasoning").

A small model drafts each reasoning step (one generation that stops at the step delimiter);
the large model only judges the step and keeps it when its score reaches ``threshold``,
otherwise it writes that step itself. Steps go on until one ends the solution (an
end-of-sequence or a user stop string) or ``max_steps`` is reached. Reasoning tolerates
approximate steps, so the large model's costly decoding is spent only where the draft falls
short (the paper's insight), unlike speculative decoding, which needs token-level agreement.

Everything here is text-level: each model continues its own rendering of the prompt (its own
chat template) plus the steps so far as text, and the judge reads text. The two models need
not share a tokenizer, so none is required or checked. (Candidate token ids are concatenated
only when one model wrote every kept step; a mixed solution's ids would mix vocabularies.)

The small model is the ``drafter`` field: a `Generator` in Python, or from the command line
a model named as ``--model`` names one (``--strategy.drafter PATH.gguf``; with ``--backend
openai`` a model id on the same server), loaded by `metaloom run` / `metaloom eval` as the first
model was. ``None`` drafts with the model being run (that measures the machinery, not a speed-up).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from metaloom.errors import BudgetExceeded
from metaloom.generator.types import Completion, Generator, Request, render
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, budget_event, component, ensure, extract_all, fraction, guarded, positive, reseed
from metaloom.meta.types import Result, usage_dict
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.prompting import fill
from metaloom.score.protocols import Prompt, as_chat
from metaloom.score.step_judge import STEP_TEMPLATE, StepJudge

METHODS = ("judge", "likelihood")


def step_sampling() -> SamplingParams:
    """Greedy steps; ``max_tokens`` caps one step."""
    return SamplingParams(temperature=0.0, max_tokens=128)


def ends_solution(c: Completion, delimiter: Sequence[str]) -> bool:
    """Whether a step ends the solution: it stopped, but not at a step delimiter (an
    end-of-sequence, a user stop string), or it failed. A step cut at the per-step token limit
    ("length") leaves the solution open, as in tree search."""
    if c.finish_reason == "stop":
        return not (isinstance(c.stop_reason, str) and c.stop_reason in delimiter)
    return c.finish_reason != "length"


@dataclass(frozen=True)
class SpecReason:
    """A small model drafts each step, the large model (the one being run) judges it and
    rewrites it when its score is below ``threshold``.

    ``method``: "judge" asks the large model whether the step is correct (``judge_template``,
    fields {prompt}, {previous}, {step}) and reads P(yes) with one batched `Generator.score`
    call (`metaloom.score.step_judge.StepJudge`); "likelihood" scores the drafted step as a
    continuation of the large model's context in one `Generator.score` call and takes its
    per-token geometric-mean probability (an empty draft scores 0). A step is kept when its
    score >= ``threshold``. Each judgement charges one scorer call. ``delimiter``: the stop
    strings that end a step (kept in the text); ``params.max_tokens`` caps one step,
    ``max_steps`` the solution. The trace has one "step" event per step (the draft, its score,
    whether it was accepted, who wrote the kept text, each model's usage) and a "models" event
    with the small and the large model's totals."""

    drafter: Generator | None = None
    threshold: float = 0.5
    method: str = "judge"
    max_steps: int = 16
    delimiter: tuple[str, ...] = ("\n\n",)
    judge_template: str = STEP_TEMPLATE
    params: SamplingParams = field(default_factory=step_sampling)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        component("drafter", self.drafter, Generator, "None (the model being run drafts) or a Generator instance",
                  optional=True)
        ensure(not isinstance(self.threshold, bool), "threshold", self.threshold, "a number in [0, 1]")
        fraction("threshold", self.threshold, closed_low=True)
        ensure(self.method in METHODS, "method", self.method, f"one of {METHODS}")
        positive("max_steps", self.max_steps)
        ensure(isinstance(self.delimiter, tuple) and len(self.delimiter) > 0
               and all(isinstance(d, str) and d for d in self.delimiter), "delimiter", self.delimiter,
               "one or more non-empty stop strings")
        ensure(isinstance(self.judge_template, str), "judge_template", self.judge_template, "a template string")
        blank = {"prompt": "", "previous": ""}
        # fill raises InvalidParameter("judge_template", ...) for a field but {prompt}, {previous}, {step}
        ensure(fill(self.judge_template, "judge_template", **blank, step="")
               != fill(self.judge_template, "judge_template", **blank, step="x"),
               "judge_template", self.judge_template, "a template using {step}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        small_gen = self.drafter if self.drafter is not None else generator
        generator.capabilities.require("score", type(generator).__name__, "spec_reason judges steps with the "
                                                                            "large model's Generator.score")

        def body(run: Run) -> None:
            small, large = run.ledger.child(), run.ledger.child()  # each model's own spending
            bases = {"small": render(small_gen, prompt), "large": render(generator, prompt)}
            kept: list[tuple[Completion, str]] = []  # each kept step and who wrote it
            try:
                for i in range(self.max_steps):
                    step, writer = self.one_step(run, prompt, {"small": small_gen, "large": generator},
                                                 {"small": small, "large": large}, bases, kept, i)
                    kept.append((step, writer))
                    if ends_solution(step, self.delimiter):
                        break
            except BudgetExceeded as exc:
                budget_event(run, exc)
                self.finish(run, kept, small, large, small_gen is generator, stopped=True)
                raise
            self.finish(run, kept, small, large, small_gen is generator, stopped=False)

        return guarded(ledger, body)

    def one_step(self, run: Run, prompt: Prompt, gens: dict[str, Generator], ledgers: dict[str, Ledger],
                 bases: dict[str, str], kept: list[tuple[Completion, str]], index: int) -> tuple[Completion, str]:
        """Draft one step, judge it, rewrite it if rejected: (the kept step, "small" or "large")."""
        texts = [c.text for c, _ in kept]
        before = {k: ledger.usage for k, ledger in ledgers.items()}
        params = dataclasses.replace(reseed(self.params, index), n=1,
                                     stop=tuple(dict.fromkeys((*self.params.stop, *self.delimiter))),
                                     include_stop_str_in_output=True)

        def spent() -> dict[str, dict]:
            return {f"{k}_usage": usage_dict(ledgers[k].usage.since(before[k])) for k in ledgers}

        def write(who: str) -> Completion:
            request = Request(bases[who] + "".join(texts), params)
            out = gens[who].generate([request], ledger=ledgers[who])[0][0]
            if out.finish_reason == "budget":
                run.event("step", index=index, writer=who, draft=out.text, score=None, accepted=None,
                          finish="budget", **spent())
                ledgers[who].check()  # names the limit that was passed
                raise BudgetExceeded("budget", 0, 0)  # pragma: no cover - a generator that said "budget" without one
            return out

        draft = write("small")
        score = self.judge(prompt, gens["large"], bases["large"], texts, draft, ledgers["large"])
        accepted = score >= self.threshold
        step = draft if accepted else write("large")
        run.event("step", index=index, draft=draft.text, score=score, accepted=accepted,
                  writer="small" if accepted else "large", text=step.text, finish=step.finish_reason, **spent())
        return step, "small" if accepted else "large"

    def judge(self, prompt: Prompt, large: Generator, base: str, texts: list[str], draft: Completion,
              ledger: Ledger) -> float:
        """The large model's score of the drafted step, in [0, 1]."""
        if self.method == "judge":
            judge = StepJudge(generator=large, template=self.judge_template)
            return float(judge.score_steps(prompt, [[*texts, draft.text]], ledger=ledger, last_only=True)[0][-1])
        ledger.charge(scorer_calls=1)
        if not draft.text:
            return 0.0
        scored = large.score(base + "".join(texts), [draft.text], ledger=ledger)[0]
        mean = scored.mean_logprob
        return math.exp(mean) if math.isfinite(mean) else 0.0

    def finish(self, run: Run, kept: list[tuple[Completion, str]], small: Ledger, large: Ledger, one_model: bool,
               *, stopped: bool) -> None:
        """The kept steps as the one candidate (finish "budget" when a budget cut the run), and
        each model's spending."""
        run.event("models", small=usage_dict(small.usage), large=usage_dict(large.usage),
                  steps_by_small=sum(w == "small" for _, w in kept), steps_by_large=sum(w == "large" for _, w in kept))
        if not kept:
            return
        steps = [c for c, _ in kept]
        same = one_model or len({w for _, w in kept}) == 1
        last = steps[-1]
        finish = "budget" if stopped else last.finish_reason if ends_solution(last, self.delimiter) else "length"
        solution = Completion("".join(c.text for c in steps), tuple(t for c in steps for t in c.token_ids) if same else (),
                              tuple(lp for c in steps for lp in c.logprobs) if same else (), finish,
                              last.stop_reason if finish == "stop" else None)
        run.candidates.append(solution)
        run.answers.extend(extract_all(self.extractor, [solution]))
        run.best_index = 0
