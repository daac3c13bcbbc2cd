"""Monte Carlo tree search over reasoning steps with UCT (Kocsis & Szepesvári 2006; as used
for LLM reasoning by e.g. Hao et al. 2023, RAP, and Zhang et al. 2024, ReST-MCTS*).

Each iteration: from the root, descend by UCT

    UCT(c) = Q(c) + c_puct · sqrt(ln N(parent) / N(c)),   Q(c) = value sum / visits

(an unvisited child first) to a leaf; expand the leaf into ``k`` children; evaluate each
child by the step scorer (its path's aggregate score; the registered ``rollout`` scorer makes
this the Monte-Carlo rollout value); back the value up to the root. A finished leaf is not
expanded: its score is backed up again. To batch, each round selects ``parallel`` leaves
with a virtual loss (a pending visit valued 0) so they differ, expands them in one generator
call and scores the children in one scorer call. The answer is the best-scoring finished
solution (``select``).
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
from metaloom.search.tree import Node


def uct(value: float, visits: int, parent_visits: int, c: float) -> float:
    """The UCT score of a child; unvisited children come first."""
    if visits == 0:
        return math.inf
    return value / visits + c * math.sqrt(math.log(max(parent_visits, 1)) / visits)


def visits(n: Node) -> int:
    return int(n.extra.get("visits", 0))


def backup(node: Node, value: float) -> None:
    at: Node | None = node
    while at is not None:
        at.extra["visits"] = visits(at) + 1
        at.extra["value"] = float(at.extra.get("value", 0.0)) + value
        at = at.parent


@dataclass(frozen=True)
class MCTS(SearchConfig):
    """Monte Carlo tree search with UCT: ``iterations`` rounds, ``parallel`` leaves per round,
    ``k`` children per expansion, exploration constant ``c``."""

    iterations: int = 8
    k: int = 3
    parallel: int = 2
    c: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("iterations", self.iterations)
        positive("k", self.k)
        positive("parallel", self.parallel)
        if not isinstance(self.c, (int, float)) or self.c < 0:
            raise InvalidParameter("c", self.c, "a number >= 0 (the exploration constant)")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "mcts", prompt, generator, ledger, self.search)

    def select_leaf(self, root: Node, pending: dict[int, int]) -> Node | None:
        """Descend by UCT (pending selections count as visits valued 0) to a node with no
        children; None when every path below is exhausted (finished or pruned)."""
        at = root
        while at.children:
            live = [ch for ch in at.children if not _exhausted(ch)]
            if not live:
                return None
            n_parent = visits(at) + pending.get(at.id, 0)
            at = max(live, key=lambda ch: (uct(float(ch.extra.get("value", 0.0)), visits(ch) + pending.get(ch.id, 0),
                                               n_parent, self.c), -ch.id))
        return at

    def search(self, s: Search) -> None:
        root = s.tree.root
        root.extra["visits"], root.extra["value"] = 0, 0.0
        for _ in range(self.iterations):
            pending: dict[int, int] = {}
            leaves: list[Node] = []
            for _ in range(self.parallel):
                leaf = self.select_leaf(root, pending)
                if leaf is None or leaf in leaves:
                    break
                at: Node | None = leaf
                while at is not None:  # virtual loss
                    pending[at.id] = pending.get(at.id, 0) + 1
                    at = at.parent
                leaves.append(leaf)
            if not leaves:
                s.stop = "exhausted"
                return
            for leaf in [x for x in leaves if x.finished]:  # a finished leaf: its value again
                backup(leaf, leaf.score or 0.0)
            grow = [x for x in leaves if not x.finished]
            if grow:
                children = s.step(grow, [self.k] * len(grow))
                for ch in children:
                    ch.extra.setdefault("visits", 0)
                    ch.extra.setdefault("value", 0.0)
                    if ch.finish != "budget":
                        backup(ch, ch.score or 0.0)
        s.stop = "iterations"


def _exhausted(n: Node) -> bool:
    """Nothing left to do below ``n``: a finished node is never exhausted (re-selecting it
    re-backs its value, as a terminal state in UCT); a node whose children are all exhausted is."""
    if n.state == "pruned" or n.finish == "budget":
        return True
    return bool(n.children) and all(_exhausted(ch) for ch in n.children)
