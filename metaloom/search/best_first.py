"""Best-first search over reasoning steps: keep every generated step on a priority queue and
always expand the most promising one (Pearl 1984, "Heuristics"; for LLM reasoning e.g. Koh et
al. 2024). Here the priority is the path's aggregate score. A* decoding
(`metaloom.search.a_star`) is the same loop with A*'s priority.

Each round pops the ``parallel`` best open nodes (1 is the textbook algorithm; more batches
the generator call) and expands each into ``k`` children. A finished solution scoring at least
``goal_score`` is a goal: the search stops when ``solutions`` goals have been popped, when the
queue is empty, or after ``max_rounds`` rounds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import positive
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.core import Search, SearchConfig, run_search
from metaloom.search.tree import Node


def priority_search(s: Search, cost: Callable[[Search, Node], float], *, k: int, parallel: int, solutions: int,
                    max_rounds: int, goal_score: float = 0.0) -> None:
    """Expand the lowest-``cost`` nodes first (ties to the older node) until ``solutions``
    finished nodes scoring at least ``goal_score`` have been popped (a finished node below it is
    a dead end, not a goal). Each node's cost is stored on it as ``priority``."""
    queue: list[tuple[float, int, Node]] = []

    def push(nodes: list[Node]) -> None:
        for n in nodes:
            if n.finish == "budget":
                continue
            f = cost(s, n)
            n.extra["priority"] = f
            heapq.heappush(queue, (f, n.id, n))

    push(s.step([s.tree.root], [k]))
    goals = 0
    for _ in range(max_rounds):
        batch: list[Node] = []
        while queue and len(batch) < parallel:
            _, _, node = heapq.heappop(queue)
            if node.finished:
                if (node.score or 0.0) < goal_score:
                    continue
                goals += 1
                node.extra["goal"] = goals
                if goals >= solutions:
                    break
                continue
            batch.append(node)
        if goals >= solutions:
            s.stop = "finished"
            s.tree.prune([n for _, _, n in queue] + batch)
            return
        if not batch:
            s.stop = "exhausted"
            return
        push(s.step(batch, [k] * len(batch)))
    s.stop = "max_rounds"


@dataclass(frozen=True)
class PriorityConfig(SearchConfig):
    """The fields of the priority-queue searches (best-first, A*)."""

    k: int = 4
    parallel: int = 1
    solutions: int = 1
    max_rounds: int = 32
    goal_score: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("k", "parallel", "solutions", "max_rounds"):
            positive(name, getattr(self, name))

    def search_by(self, s: Search, cost: Callable[[Search, Node], float]) -> None:
        priority_search(s, cost, k=self.k, parallel=self.parallel, solutions=self.solutions,
                        max_rounds=self.max_rounds, goal_score=self.goal_score)


@dataclass(frozen=True)
class BestFirst(PriorityConfig):
    """Best-first search: expand the best-scoring open step first, ``k`` children each,
    ``parallel`` per round."""

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "best_first", prompt, generator, ledger,
                          lambda s: self.search_by(s, lambda _, n: -(n.score or 0.0)))
