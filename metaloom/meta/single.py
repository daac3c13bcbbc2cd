"""One output, no search: the baseline every test-time-scaling curve starts from (greedy by
default; with a temperature, one sample)."""

from __future__ import annotations

from dataclasses import dataclass, field

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, component, ensure, extract_all, generate_one, guarded, stop_if_budget
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.protocols import Prompt, as_chat


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=256)


@dataclass(frozen=True)
class Single:
    """One generator call; its output is the result (greedy unless the params sample)."""

    params: SamplingParams = field(default_factory=_greedy)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            out = generate_one(run, generator, prompt, self.params, "sample")
            run.candidates.append(out)
            run.answers.extend(extract_all(self.extractor, [out]))
            run.best_index = 0
            stop_if_budget(run, [out])

        return guarded(ledger, body)
