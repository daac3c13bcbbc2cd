"""Helpers every strategy shares, so no strategy repeats another's loop: the run record
(`Run`, `guarded`), sampling (`sample_n`, `continue_all`, `nested`), scoring with typed failures
(`score`), selection (`select_top`) and prompt plumbing (`extend`; `metaloom.generator.types.render`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from metaloom.errors import BudgetExceeded, InvalidParameter, ScorerFailed
from metaloom.generator.types import Completion, Generator, Request, render
from metaloom.ledger import Ledger, Usage
from metaloom.meta.types import Event, Result, Strategy, usage_dict
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.protocols import Prompt, Scorer


def default_sampling() -> SamplingParams:
    """Diverse enough for voting and best-of-N, still coherent (Wang et al. 2023 used 0.5-0.7)."""
    return SamplingParams(temperature=0.7, max_tokens=256)


class Run:
    """Mutable record of one strategy run, local to that run: what it has gathered so far,
    so a budget stop or a scorer failure can still report it."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger  # the run's own child ledger: its usage is the Result's usage
        self.candidates: list[Completion] = []
        self.scores: list[float] = []
        self.answers: list[str | None] = []
        self.events: list[Event] = []
        self.best_index: int | None = None
        self.best_text: str | None = None  # when the output is not a candidate's text (e.g. chain)

    def event(self, kind: str, **data: Any) -> None:
        self.events.append(Event(kind, data))
        self.ledger.notify(kind, data)

    def spent_since(self, before: Usage) -> dict[str, Any]:
        # `Usage.since`: counts subtract, a memory peak does not (it is known only where it rose)
        return usage_dict(self.ledger.usage.since(before))

    def result(self, stopped_reason: str | None = None) -> Result:
        best = self.best_text
        if best is None:
            best = self.candidates[self.best_index].text if self.best_index is not None else ""
        return Result(best=best, candidates=tuple(self.candidates), scores=tuple(self.scores),
                      answers=tuple(self.answers), usage=self.ledger.usage, trace=tuple(self.events),
                      stopped_reason=stopped_reason, best_index=self.best_index)


def guarded(ledger: Ledger, body: Callable[[Run], None], on_budget: Callable[[Run], object] | None = None) -> Result:
    """Run ``body`` on a child ledger. A `BudgetExceeded` ends the run cleanly with what it has
    (``stopped_reason="budget"``): the candidates gathered so far (samples cut by the budget
    included, finish "budget"), and a choice among them where one can be made — by
    ``on_budget(run)`` (e.g. a vote over the answers so far), else the best of what was scored.
    A `ScorerFailed` gets this run's partial result attached."""
    run = Run(ledger.child())
    try:
        body(run)
    except BudgetExceeded as exc:
        if not any(e.kind == "budget" for e in run.events):  # a search records it before its tree
            budget_event(run, exc)
        if run.best_index is None and run.candidates:
            if on_budget is not None:
                on_budget(run)
            elif len(run.scores) == len(run.candidates):
                run.best_index = select_top(run.scores)[0]  # the best of what was scored
        return run.result("budget")
    except ScorerFailed as exc:
        run.event("scorer_failed", scorer=exc.scorer, error=f"{type(exc.cause).__name__}: {exc.cause}")
        exc.partial = run.result("scorer_failed")  # the outermost strategy's view wins
        raise
    return run.result()


def budget_event(run: Run, exc: BudgetExceeded) -> None:
    """The trace's record of a budget stop: which limit, its value, what it would have become."""
    run.event("budget", field=exc.field, limit=exc.limit, value=exc.would_be)


def check_budget(ledger: Ledger) -> None:
    """Raise `BudgetExceeded` if this ledger or an ancestor is over its budget — used after a
    nested strategy stopped on a budget that belongs to us, so we stop too."""
    ledger.check()


def stop_if_budget(run: Run, completions: Sequence[Completion]) -> None:
    """Raise `BudgetExceeded` if a generator cut any of ``completions`` short on a budget
    (finish "budget"). Call it after recording them: the work was done and is reported."""
    if any(c.finish_reason == "budget" for c in completions):
        run.ledger.check()  # names the limit that was passed
        raise BudgetExceeded("budget", 0, 0)  # pragma: no cover - a generator that said "budget" without one


def reseed(params: SamplingParams, offset: int) -> SamplingParams:
    """Distinct but reproducible seeds for successive rounds (unseeded stays unseeded)."""
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + offset)


def sample_n(run: Run, generator: Generator, prompt: Prompt, params: SamplingParams, n: int, *,
             inner: Strategy | None = None, round: int = 0) -> list[Completion]:
    """``n`` samples of ``prompt``: one request with ``n`` samples (the prompt is charged and
    prefilled once), or ``n`` runs of a nested strategy, each on a child ledger, whose chosen
    outputs become the samples."""
    before = run.ledger.usage
    if inner is None:
        out = generator.generate([Request(prompt, dataclasses.replace(reseed(params, round), n=n))], ledger=run.ledger)[0]
    else:
        out = [nested(run, generator, prompt, reseed_strategy(inner, round * n + i)) for i in range(n)]
    run.event("sample", n=n, round=round, usage=run.spent_since(before))
    return out


def reseed_strategy(strategy: Strategy, offset: int) -> Strategy:
    params = getattr(strategy, "params", None)
    if isinstance(params, SamplingParams) and dataclasses.is_dataclass(strategy):
        return dataclasses.replace(strategy, params=reseed(params, offset))  # type: ignore[type-var]
    return strategy


def nested(run: Run, generator: Generator, prompt: Prompt, inner: Strategy) -> Completion:
    """Run a nested strategy on a child ledger; its chosen output as one completion."""
    result = inner.run(prompt, generator, ledger=run.ledger.child())
    run.event("nested", strategy=type(inner).__name__, stopped_reason=result.stopped_reason,
              usage=usage_dict(result.usage))
    if result.stopped_reason == "budget":
        check_budget(run.ledger)  # our budget (not only the child's): stop here too
    if result.best_index is None:
        return Completion(result.best, (), (), "length")
    chosen = result.candidates[result.best_index]
    return Completion(result.best, chosen.token_ids, chosen.logprobs, chosen.finish_reason)


def score(run: Run, scorer: Scorer, prompt: Prompt, candidates: Sequence[Completion]) -> list[float]:
    """Scores from ``scorer``; any failure becomes `ScorerFailed` naming it. Budget stops pass
    through: they are not the scorer's fault."""
    before = run.ledger.usage
    try:
        scores = [float(s) for s in scorer.score(prompt, candidates, ledger=run.ledger)]
    except (BudgetExceeded, ScorerFailed):
        raise
    except Exception as exc:
        raise ScorerFailed(getattr(scorer, "name", type(scorer).__name__), exc) from exc
    if len(scores) != len(candidates) or not all(math.isfinite(s) or s == -math.inf for s in scores):
        bad = ValueError(f"returned {len(scores)} scores for {len(candidates)} candidates: {scores}")
        raise ScorerFailed(getattr(scorer, "name", type(scorer).__name__), bad)
    run.event("score", scorer=scorer.name, scores=scores, usage=run.spent_since(before))
    return scores


def select_top(scores: Sequence[float], k: int = 1) -> list[int]:
    """Indices of the ``k`` highest scores, best first; ties go to the earlier candidate."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def extend(first: Completion, more: Completion) -> Completion:
    """A completion continued by ``more`` (generated after first's tokens or text)."""
    return Completion(first.text + more.text, first.token_ids + more.token_ids, first.logprobs + more.logprobs,
                      more.finish_reason, more.stop_reason, error=more.error)


def continue_all(run: Run, generator: Generator, prompt: Prompt, partials: Sequence[Completion],
                 params: SamplingParams, round: int) -> list[Completion]:
    """Continue each partial completion by up to ``params.max_tokens`` tokens, in one batched
    call. Exact where the generator takes a token-id prefix (`Request.prefix`): each sample goes
    on from its own tokens, as if it had never stopped. Otherwise the prompt is rendered and
    the text so far appended, and the re-encoded text may tokenise differently at the seam.
    The prompt is charged again each round (as cached tokens where the generator keeps them)."""
    before = run.ledger.usage
    exact = "prefix" in generator.capabilities.features and all(p.token_ids for p in partials)
    base = None if exact else render(generator, prompt)
    requests = [Request(prompt, dataclasses.replace(reseed(params, round * len(partials) + i), n=1), prefix=p.token_ids)
                if exact else Request(f"{base}{p.text}", dataclasses.replace(reseed(params, round * len(partials) + i), n=1))
                for i, p in enumerate(partials)]
    more = generator.generate(requests, ledger=run.ledger)
    run.event("continue", n=len(partials), round=round, exact=exact, usage=run.spent_since(before))
    return [extend(p, m[0]) for p, m in zip(partials, more, strict=True)]


def positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidParameter(name, value, "an integer >= 1")


def fraction(name: str, value: float, *, closed_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and (0.0 <= value <= 1.0 if closed_low else 0.0 < value <= 1.0)
    if not ok:
        raise InvalidParameter(name, value, "[0, 1]" if closed_low else "(0, 1]")


def ensure(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise InvalidParameter(name, value, allowed)


def component(name: str, value: Any, kind: Any, allowed: str, *, optional: bool = False) -> None:
    """``value`` must be an instance of ``kind`` (a runtime-checkable protocol or a class), not
    the class itself (``LastNumber`` for ``LastNumber()``); None too when ``optional``."""
    ok = (optional and value is None) or (isinstance(value, kind) and not isinstance(value, type))
    ensure(ok, name, value, allowed)


def with_user_text(prompt: Prompt, text: str) -> Prompt:
    """``prompt`` with its question replaced by ``text`` (the last user message of a chat)."""
    if isinstance(prompt, str):
        return text
    last = max(i for i, m in enumerate(prompt) if m.get("role") == "user")
    return (*prompt[:last], {"role": "user", "content": text}, *prompt[last + 1:])


def generate_one(run: Run, generator: Generator, prompt: Prompt, params: SamplingParams, what: str, **data: Any) -> Completion:
    """One completion, recorded in the trace as ``what`` with its usage."""
    before = run.ledger.usage
    out = generator.generate([Request(prompt, dataclasses.replace(params, n=1))], ledger=run.ledger)[0][0]
    run.event(what, tokens=len(out.token_ids), finish_reason=out.finish_reason, usage=run.spent_since(before), **data)
    return out


def extract_all(extractor: Extractor | None, completions: Sequence[Completion]) -> list[str | None]:
    return [] if extractor is None else [extractor.extract(c.text) for c in completions]


def collect(run: Run, generator: Generator, prompt: Prompt, params: SamplingParams, n: int,
            extractor: Extractor | None, *, inner: Strategy | None = None, round: int = 0) -> list[Completion]:
    """`sample_n`, then record the samples as candidates and their extracted answers on ``run``."""
    candidates = sample_n(run, generator, prompt, params, n, inner=inner, round=round)
    run.candidates.extend(candidates)
    run.answers.extend(extract_all(extractor, candidates))
    stop_if_budget(run, candidates)
    return candidates
