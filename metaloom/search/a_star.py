"""A*-decoding (Chatziveroglou 2025, "A*-Decoding: Token-Efficient Inference Scaling"): search
the partial solutions in order of f(s) = g(s) + h(s), lowest first, with the heuristic from
process supervision, h(s) = 1 - r(s), r the step scorer's score of the path (the paper's
choice). The cost so far g is the path's mean per-token negative log-likelihood under the
model, times ``cost_weight``: the paper charges a path for what it took to reach; this is our
reading of that cost, and ``cost_weight = 0`` makes the search greedy best-first on the PRM.

The loop is `metaloom.search.best_first.priority_search`: pop the best state, sample ``k``
continuations to the next step boundary, score them, push them; a finished solution popped
from the queue is a goal (with ``goal_score`` > 0, only one scoring at least that: with an
exact checker, a wrong final answer is a dead end). ``parallel`` > 1 pops several states per round (one batched call).
"""

from __future__ import annotations

from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.best_first import PriorityConfig
from metaloom.search.core import Search, run_search
from metaloom.search.tree import Node


def a_star_cost(s: Search, node: Node, cost_weight: float) -> float:
    """f = g + h: ``cost_weight`` · mean NLL per token of the path, plus 1 - score."""
    logprobs = [lp for n in s.tree.path(node) for lp in n.logprobs]
    g = -sum(logprobs) / len(logprobs) if logprobs else 0.0
    return cost_weight * g + (1.0 - (node.score or 0.0))


@dataclass(frozen=True)
class AStar(PriorityConfig):
    """A*-decoding (Chatziveroglou 2025): ``k`` children per expansion, ``parallel`` states per round."""

    cost_weight: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.cost_weight, (int, float)) or self.cost_weight < 0:
            raise InvalidParameter("cost_weight", self.cost_weight, "a number >= 0")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "a_star", prompt, generator, ledger,
                          lambda s: self.search_by(s, lambda search, n: a_star_cost(search, n, self.cost_weight)))
