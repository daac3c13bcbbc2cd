"""Budget forcing (s1, Muennighoff et al. 2025, "s1: Simple test-time scaling"): control how
long a model thinks. If it tries to end its thinking before ``min_thinking_tokens``, the
end-of-thinking marker is suppressed and "Wait" appended, so it keeps reasoning (and often
corrects itself); at ``max_thinking_tokens`` thinking is cut and the answer forced by
appending the end-of-thinking marker and an answer prefix.

Built on the plain `Generator` interface with raw-text requests: thinking is generated with
the end-of-thinking marker as a stop string; "suppressing" it means not keeping it and
continuing the text with "Wait" instead. Thinking tokens are the tokens the model generated
while thinking (what the engine counted, the stop-marker token and any end-of-sequence
included); the appended "Wait"s are prompt text, not generated. Each continuation re-sends
the whole text as a prompt, so input tokens grow with every "Wait" — the ledger shows it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from metaloom.generator.types import Completion, Generator, render
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    Run,
    component,
    ensure,
    extract_all,
    generate_one,
    guarded,
    positive,
    stop_if_budget,
)
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.protocols import Prompt, as_chat


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0)  # s1 evaluates with greedy decoding


@dataclass(frozen=True)
class BudgetForcing:
    """Think at least ``min_thinking_tokens`` and at most ``max_thinking_tokens`` (s1).

    Markers are text, so any model's convention fits (s1 itself used Qwen's
    "<|im_start|>think" / "<|im_start|>answer"). ``max_waits`` caps the number of "Wait"s
    (``None``: as many as the minimum needs). ``params.max_tokens`` is not used."""

    min_thinking_tokens: int = 0
    max_thinking_tokens: int = 512
    answer_max_tokens: int = 64
    think_start: str = "<think>\n"
    think_end: str = "</think>"
    wait: str = "\nWait"
    answer_prefix: str = "\nFinal answer:"
    answer_stop: tuple[str, ...] = ()
    max_waits: int | None = None
    params: SamplingParams = field(default_factory=_greedy)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        positive("max_thinking_tokens", self.max_thinking_tokens)
        positive("answer_max_tokens", self.answer_max_tokens)
        low = self.min_thinking_tokens
        ensure(isinstance(low, int) and not isinstance(low, bool) and 0 <= low <= self.max_thinking_tokens,
               "min_thinking_tokens", low, f"an integer in [0, max_thinking_tokens={self.max_thinking_tokens}]")
        for name in ("think_start", "answer_prefix"):  # may be empty: a model without that marker
            ensure(isinstance(getattr(self, name), str), name, getattr(self, name), "a string")
        for name in ("think_end", "wait"):  # the wait text is what keeps the model thinking
            value = getattr(self, name)
            ensure(isinstance(value, str) and bool(value), name, value, "a non-empty string")
        ensure(isinstance(self.answer_stop, tuple | list) and all(isinstance(s, str) and s for s in self.answer_stop),
               "answer_stop", self.answer_stop, "a tuple of non-empty strings")
        waits = self.max_waits
        ensure(waits is None or (isinstance(waits, int) and not isinstance(waits, bool) and waits >= 0), "max_waits",
               waits, "None (as many as the minimum needs) or an integer >= 0")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        base = render(generator, prompt) + self.think_start

        def body(run: Run) -> None:
            thinking, spent, waits = "", 0, 0
            ids: tuple[int, ...] = ()
            lps: tuple[float, ...] = ()
            while spent < self.max_thinking_tokens:
                params = dataclasses.replace(self.params, max_tokens=self.max_thinking_tokens - spent, stop=(self.think_end,))
                c = generate_one(run, generator, base + thinking, params, "think", waits=waits)
                thinking, spent, ids, lps = thinking + c.text, spent + len(c.token_ids), ids + c.token_ids, lps + c.logprobs
                if c.finish_reason == "budget":  # what was thought so far is the candidate
                    run.candidates.append(Completion(thinking, ids, lps, "budget"))
                    stop_if_budget(run, [c])
                # the model ended its thinking (marker or end-of-sequence) too early: suppress, append "Wait"
                if c.finish_reason == "length" or spent >= self.min_thinking_tokens:
                    break
                if self.max_waits is not None and waits >= self.max_waits:
                    break
                thinking, waits = thinking + self.wait, waits + 1
            forced = spent >= self.max_thinking_tokens
            run.event("thinking", tokens=spent, waits=waits, forced_answer=forced)
            params = dataclasses.replace(self.params, max_tokens=self.answer_max_tokens, stop=self.answer_stop)
            head = thinking + self.think_end + self.answer_prefix
            a = generate_one(run, generator, base + head, params, "answer")
            run.candidates.append(Completion(head + a.text, ids + a.token_ids, lps + a.logprobs, a.finish_reason,
                                             a.stop_reason))
            run.answers.extend(extract_all(self.extractor, [a]))
            run.best_index, run.best_text = 0, a.text.strip()
            stop_if_budget(run, [a])

        return guarded(ledger, body)
