"""LLM-as-judge: a prompted model's probability of "Yes", as a scorer (is this answer
correct?) and as a pairwise MBR utility (do these two answers agree?) — Zheng et al. 2023,
"Judging LLM-as-a-Judge".

Any `Generator` can judge; its usage is charged to the ledger like any generation, plus one
scorer call. Two ways to read P(yes), chosen by the user (nothing is inferred):

- ``method="compare"`` (default): `Generator.score` reads log p(Yes) and log p(No) as
  continuations of the judge's question (one batched call per question, or one for all the
  questions where the generator takes them together, `score_all`: a remote server then
  computes what they share once; a word may span several tokens), and P(yes) = p(Yes) /
  (p(Yes) + p(No)). Works on any generator that scores (the local engine, a server with
  prompt log-probabilities).
- ``method="sample"``: one greedy token. If it reads "yes", P(yes) = p(token); if "no",
  1 - p(token) (the mass not on "no" is credited to "yes"); anything else scores 0.
  Works on any generator, token ids unknown (e.g. a remote server without logit bias).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion, Generator, Request
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.score.prompting import fill, score_all, user_text
from metaloom.score.protocols import Prompt

JUDGE_TEMPLATE = ("{prompt}\n\nProposed answer:\n{candidate}\n\n"
                  "Is the proposed answer correct? Answer Yes or No.")
PAIR_TEMPLATE = ("Question:\n{prompt}\n\nAnswer A:\n{a}\n\nAnswer B:\n{b}\n\n"
                 "Do answers A and B reach the same final answer? Answer Yes or No.")
METHODS = ("compare", "sample")


def yes_probability(generator: Generator, questions: Sequence[str], *, ledger: Ledger, method: str = "compare",
                    yes: str = "Yes", no: str = "No", chat: bool = True) -> list[float]:
    """P(yes) for each judge question."""
    if method not in METHODS:
        raise InvalidParameter("method", method, f"one of {METHODS}")
    if not yes or not no or yes == no:
        raise InvalidParameter("yes/no words", (yes, no), "two different non-empty words")
    if not questions:
        return []

    def prompt(q: str) -> str | tuple[dict[str, str], ...]:
        return ({"role": "user", "content": q},) if chat else q

    if method == "sample":
        params = SamplingParams(temperature=0.0, max_tokens=1)
        outs = generator.generate([Request(prompt(q), params) for q in questions], ledger=ledger)
        if any(o[0].finish_reason == "budget" for o in outs):
            ledger.check()
        return [_read_sample(o[0], yes, no) for o in outs]
    generator.capabilities.require("score", type(generator).__name__, "method='compare' reads p(yes) by scoring; "
                                   "use method='sample'")
    scored = score_all(generator, [(prompt(q), (yes, no)) for q in questions], ledger=ledger)
    return [1.0 / (1.0 + math.exp(said_no.logprob - said_yes.logprob)) for said_yes, said_no in scored]


def _read_sample(c: Completion, yes: str, no: str) -> float:
    word = c.text.strip().lower()
    p = math.exp(c.logprobs[0]) if c.logprobs else 0.0
    if word.startswith(yes.strip().lower()):
        return p
    if word.startswith(no.strip().lower()):
        return 1.0 - p
    return 0.0


@dataclass(frozen=True)
class LLMJudge:
    """Scores a candidate by a judge model's P(yes) that it answers the prompt correctly.
    ``template`` fields: {prompt} (the question) and {candidate}."""

    generator: Generator
    method: str = "compare"
    template: str = JUDGE_TEMPLATE
    yes: str = "Yes"
    no: str = "No"
    name: str = "judge"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        q = user_text(prompt)
        questions = [fill(self.template, "template", prompt=q, candidate=c.text) for c in candidates]
        return yes_probability(self.generator, questions, ledger=ledger, method=self.method, yes=self.yes,
                               no=self.no)


@dataclass(frozen=True)
class PairwiseJudge:
    """MBR utility u(h, r) = the judge's P(yes) that h and r agree (1 on the diagonal, not
    asked). ``matrix`` takes the ledger; plain ``__call__`` (the `Utility` protocol, which has
    no ledger) charges a throwaway ledger, so strategies call ``matrix``."""

    generator: Generator
    prompt: str = ""
    method: str = "compare"
    template: str = PAIR_TEMPLATE
    yes: str = "Yes"
    no: str = "No"
    name: str = "judge"

    def matrix(self, hypotheses: Sequence[str], references: Sequence[str], *, ledger: Ledger,
               prompt: str | None = None) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        question = self.prompt if prompt is None else prompt
        pairs = [(i, j) for i, h in enumerate(hypotheses) for j, r in enumerate(references) if h != r]
        asked = [fill(self.template, "template", prompt=question, a=hypotheses[i], b=references[j]) for i, j in pairs]
        probs = yes_probability(self.generator, asked, ledger=ledger, method=self.method, yes=self.yes, no=self.no)
        u = [[1.0] * len(references) for _ in hypotheses]
        for (i, j), p in zip(pairs, probs, strict=True):
            u[i][j] = p
        return u

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        return self.matrix(hypotheses, references, ledger=Ledger())
