"""Chain: a small program of generator calls, each step's output feeding the next.

The default is zero-shot chain of thought as two calls (Kojima et al. 2022, "Large Language
Models are Zero-Shot Reasoners"; Wei et al. 2022): first elicit reasoning, then ask for the
answer given that reasoning, then (optionally) extract it. Steps are templates over
``{prompt}`` (the question) and ``{step1}``, ``{step2}``, ... (earlier outputs), so longer
chains — rewrite the question, draft, answer — are a config change, not new code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    component,
    ensure,
    extract_all,
    generate_one,
    guarded,
    reseed,
    stop_if_budget,
    with_user_text,
)
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.prompting import fill, user_text
from metaloom.score.protocols import Prompt, as_chat

THINK = "{prompt}\nLet's think step by step."
ANSWER = "{prompt}\nLet's think step by step.\n{step1}\nTherefore, the final answer is"


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class Chain:
    """A program of generator calls (default: think step by step, then answer).

    Runs ``steps`` in order; step i may use ``max_tokens[i]`` tokens (``params.max_tokens``
    is not used); ``stop`` applies to the last step. Each step runs on its own child ledger,
    so the trace shows what each call cost. The chosen output is the last step's text."""

    steps: tuple[str, ...] = (THINK, ANSWER)
    max_tokens: tuple[int, ...] = (256, 32)
    stop: tuple[str, ...] = ()
    params: SamplingParams = field(default_factory=_greedy)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        """Step i (1-based) may use ``{prompt}`` and the outputs ``{step1}`` .. ``{step<i-1>}``,
        and must use at least one of them (so step 1 uses the question)."""
        ensure(isinstance(self.steps, tuple | list) and len(self.steps) >= 1 and all(isinstance(t, str) for t in self.steps),
               "steps", self.steps, "a tuple of at least one template string")
        ensure(isinstance(self.max_tokens, tuple | list) and len(self.max_tokens) == len(self.steps), "max_tokens",
               self.max_tokens, f"a tuple of one limit per step ({len(self.steps)})")
        ensure(all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in self.max_tokens), "max_tokens",
               self.max_tokens, "integers >= 1")
        for i, template in enumerate(self.steps):
            fields = ["prompt", *(f"step{j}" for j in range(1, i + 1))]
            # fill raises InvalidParameter("steps", ...) for a field this step cannot know (yet)
            used = fill(template, "steps", **dict.fromkeys(fields, "")) != fill(template, "steps", **dict.fromkeys(fields, "x"))
            ensure(used, "steps", template, f"step {i + 1} using at least one of {{{'}, {'.join(fields)}}}")
        ensure(isinstance(self.stop, tuple | list) and all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a tuple of non-empty strings")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        question = user_text(prompt)

        def body(run):
            outputs: dict[str, str] = {}
            for i, (template, limit) in enumerate(zip(self.steps, self.max_tokens, strict=True)):
                last = i == len(self.steps) - 1
                text = fill(template, "steps", prompt=question, **outputs)
                params = dataclasses.replace(reseed(self.params, i), max_tokens=limit, stop=self.stop if last else ())
                step_run = type(run)(run.ledger.child())  # the step's own ledger, forwarding to ours
                c = generate_one(step_run, generator, with_user_text(prompt, text), params, "step", index=i + 1)
                run.events.extend(step_run.events)
                run.candidates.append(c)
                stop_if_budget(run, [c])
                outputs[f"step{i + 1}"] = c.text.strip()
            run.best_index = len(run.candidates) - 1
            run.best_text = outputs[f"step{len(self.steps)}"]
            if self.extractor is not None:
                run.answers.extend([None] * (len(run.candidates) - 1) + extract_all(self.extractor, run.candidates[-1:]))

        return guarded(ledger, body)
