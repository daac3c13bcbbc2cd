"""Minimum Bayes risk decoding over samples: pick the sample with the highest expected
utility against the others, which stand in for references drawn from the model (Eikema &
Aziz 2020, 2022; Kumar & Byrne 2004). The model's consensus, not its mode.

EU(h) = (1/N) Σ_j u(h, y_j) over all N samples (itself included — the Monte Carlo estimate).
The utility matrix is computed over *distinct* texts only and weighted by multiplicity: the
same figures with fewer utility evaluations (a pairwise LLM judge is costly).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from metaloom.errors import BudgetExceeded, ScorerFailed
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import Run, collect, component, default_sampling, ensure, guarded, positive, select_top
from metaloom.meta.types import Result, Strategy
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.mbr import mbr_select
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt, Utility, as_chat


def default_utility() -> Utility:
    """chrF from `metaloom.score.utility` (imported when first needed: sacrebleu is optional)."""
    from metaloom.score.utility import make_utility

    return make_utility("chrf")


def utility_matrix(run: Run, utility: Utility, hyps: list[str], refs: list[str], prompt: Prompt) -> list[list[float]]:
    """``u[i][j]``; one scorer call. A utility with a ledger-aware ``matrix`` method (an LLM
    judge) charges its own usage there; a failure becomes `ScorerFailed` naming the utility."""
    name = getattr(utility, "name", type(utility).__name__)
    try:
        matrix = getattr(utility, "matrix", None)
        if callable(matrix):
            return [list(map(float, row)) for row in matrix(hyps, refs, ledger=run.ledger, prompt=user_text(prompt))]
        run.ledger.charge(scorer_calls=1)
        return [list(map(float, row)) for row in utility(hyps, refs)]
    except (BudgetExceeded, ScorerFailed):
        raise
    except Exception as exc:
        raise ScorerFailed(name, exc) from exc


@dataclass(frozen=True)
class MBR:
    """Minimum Bayes risk: the sample with the highest expected utility against the others.

    ``n`` samples; each scores its expected utility against all samples; the highest wins
    (earliest on ties). With an ``extractor``, utilities compare extracted answers."""

    n: int = 8
    utility: Utility = field(default_factory=default_utility)
    params: SamplingParams = field(default_factory=default_sampling)
    extractor: Extractor | None = None
    inner: Strategy | None = None

    def __post_init__(self) -> None:
        positive("n", self.n)
        # called as utility(hyps, refs) -> matrix; a name is optional (the trace falls back to the type's)
        ensure(callable(self.utility) and not isinstance(self.utility, type), "utility", self.utility,
               "a Utility instance (called on hypotheses and references)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)
        component("inner", self.inner, Strategy, "None or a Strategy instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        def body(run: Run) -> None:
            candidates = collect(run, generator, prompt, self.params, self.n, self.extractor, inner=self.inner)
            texts = [a or "" for a in run.answers] if self.extractor is not None else [c.text for c in candidates]
            counts = Counter(texts)
            distinct = list(counts)
            before = run.ledger.usage
            u = utility_matrix(run, self.utility, distinct, distinct, prompt)
            _, eu = mbr_select(u, weights=[counts[r] for r in distinct])  # references weighted by multiplicity
            expected = dict(zip(distinct, eu, strict=True))
            run.scores.extend(expected[t] for t in texts)
            run.best_index = select_top(run.scores)[0]
            run.event("mbr", utility=getattr(self.utility, "name", type(self.utility).__name__),
                      distinct=len(distinct), matrix=u, usage=run.spent_since(before))

        return guarded(ledger, body)
