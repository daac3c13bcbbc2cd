"""REBASE, reward-balanced search (Wu et al. 2024, "Inference Scaling Laws: An Empirical
Analysis of Compute-Optimal Inference for Problem-Solving with Language Models", §3.2).

A budget of ``n`` samples. The root is expanded into ``n`` first steps. At each depth, with
``B`` the samples not yet spent on finished solutions (``n`` minus the solutions finished so
far), every open node j of the current depth gets

    W_j = Round(B · exp(R_j / T_b) / Σ_k exp(R_k / T_b))

children, R_j its score and T_b the balance temperature (``temperature``): a low temperature
spends the budget on the best nodes, a high one spreads it evenly. A node given no child is
pruned. The search ends when the budget is spent on finished solutions or no node is open.
The paper aggregates the finished solutions by weighted majority voting; set
``select="weighted_vote"`` with an ``extractor`` to do the same (the default picks the best
score).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import positive
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.core import Search, SearchConfig, run_search


def rebase_widths(rewards: list[float], budget: int, temperature: float) -> list[int]:
    """REBASE's expansion widths: ``Round(budget · softmax(rewards / temperature))`` (round
    half up). When every width rounds to 0 while budget remains, the best node gets one child,
    so the search cannot stall."""
    if not rewards or budget <= 0:
        return [0] * len(rewards)
    top = max(rewards)
    weights = [math.exp((r - top) / temperature) for r in rewards]
    total = sum(weights)
    widths = [math.floor(budget * w / total + 0.5) for w in weights]
    if sum(widths) == 0:
        widths[rewards.index(top)] = 1
    return widths


@dataclass(frozen=True)
class Rebase(SearchConfig):
    """REBASE, reward-balanced search (Wu et al. 2024): ``n`` samples of budget, balance
    temperature ``temperature`` on the rewards."""

    n: int = 8
    temperature: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("n", self.n)
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise InvalidParameter("temperature", self.temperature, "a number > 0 (REBASE's balance temperature)")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "rebase", prompt, generator, ledger, self.search)

    def search(self, s: Search) -> None:
        children = s.step([s.tree.root], [self.n])
        while True:
            budget = self.n - len(s.finished())
            frontier = s.open_nodes(children)
            if budget <= 0 or not frontier:
                s.stop = "finished"
                return
            widths = rebase_widths([n.score or 0.0 for n in frontier], budget, self.temperature)
            s.tree.prune([n for n, w in zip(frontier, widths, strict=True) if w == 0])
            kept = [(n, w) for n, w in zip(frontier, widths, strict=True) if w > 0]
            for n, w in kept:
                n.extra["width"] = w
            children = s.step([n for n, _ in kept], [w for _, w in kept])
