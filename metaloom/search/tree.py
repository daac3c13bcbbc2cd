"""The search tree: nodes hold one reasoning step each (its tokens and text, the delimiter
kept), their parent, depth, score and state; a path from the root is a partial solution.

The tree is the search's own mutable record (like `metaloom.meta.helpers.Run`), local to one
run; what leaves it is `Tree.to_dict()`, the "tree" event of `Result.trace` that `metaloom
tree` renders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metaloom.generator.types import Completion

# why a node's step ended (`Node.finish`); the first two leave the solution open
OPEN_FINISHES = ("step", "step_length")  # the delimiter; the per-step token limit without one
# complete solutions: end of sequence (or a finished constraint), the whole solution's token
# limit, the search's depth limit, a budget cut, a generator error, a cancelled row
FINISHED = ("eos", "length", "max_depth", "budget", "error", "cancelled")
STATES = ("root", "open", "expanded", "pruned", "finished")


@dataclass(eq=False)
class Node:
    """One step. ``text``/``token_ids``/``logprobs`` are the step's own; the partial solution
    is the path from the root (`Tree.path`). ``step_score`` is the step scorer's score of this
    step, ``score`` the aggregate over the path. ``extra`` holds what one algorithm tracks
    (MCTS visits and value, a particle's weight, a DVTS subtree)."""

    id: int
    parent: Node | None
    depth: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finish: str | None = None
    round: int | None = None
    step_score: float | None = None
    score: float | None = None
    state: str = "open"
    children: list[Node] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish in FINISHED

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "parent": None if self.parent is None else self.parent.id,
                               "depth": self.depth, "text": self.text, "tokens": len(self.token_ids),
                               "step_score": self.step_score, "score": self.score, "state": self.state,
                               "finish": self.finish, "round": self.round}
        out.update(self.extra)
        return out


class Tree:
    """All nodes of one search, the root (the prompt) first, and the cost of each round."""

    def __init__(self) -> None:
        self.root = Node(0, None, 0, state="root")
        self.nodes: list[Node] = [self.root]
        self.rounds: list[dict[str, Any]] = []

    def add(self, parent: Node, completion: Completion, finish: str, round: int) -> Node:
        node = Node(len(self.nodes), parent, parent.depth + 1, completion.text, completion.token_ids,
                    completion.logprobs, finish, round, state="finished" if finish in FINISHED else "open")
        parent.children.append(node)
        if parent.state in ("open", "pruned"):
            parent.state = "expanded"
        self.nodes.append(node)
        return node

    @staticmethod
    def path(node: Node) -> list[Node]:
        """The steps from the root's first child down to ``node``."""
        out: list[Node] = []
        at: Node | None = node
        while at is not None and at.parent is not None:
            out.append(at)
            at = at.parent
        return out[::-1]

    def tokens(self, node: Node) -> tuple[int, ...]:
        return tuple(t for n in self.path(node) for t in n.token_ids)

    def texts(self, node: Node) -> list[str]:
        return [n.text for n in self.path(node)]

    def step_scores(self, node: Node) -> list[float]:
        return [n.step_score if n.step_score is not None else 0.0 for n in self.path(node)]

    def completion(self, node: Node) -> Completion:
        """The partial or finished solution ending at ``node`` as one completion."""
        path = self.path(node)
        finish = {"eos": "stop", "max_depth": "length", "step": "length", "step_length": "length"}.get(
            node.finish or "", node.finish or "length")
        return Completion("".join(n.text for n in path), tuple(t for n in path for t in n.token_ids),
                          tuple(lp for n in path for lp in n.logprobs), finish)

    def prune(self, nodes: list[Node], *, finished_too: bool = False) -> None:
        """Mark ``nodes`` pruned: open ones are not expanded; with ``finished_too`` finished ones
        are no candidates either (a finished particle that resampling did not draw: particle
        filtering answers from its final population only). Other searches keep every finished
        solution they met as a candidate."""
        for n in nodes:
            if n.state == "open" or (finished_too and n.state == "finished"):
                n.state = "pruned"

    def to_dict(self, **info: Any) -> dict[str, Any]:
        return {**info, "rounds": list(self.rounds), "nodes": [n.to_dict() for n in self.nodes]}
