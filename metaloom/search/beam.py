"""Step-level beam search and diverse verifier tree search (DVTS).

Step-level beam search (Snell et al. 2024, "Scaling LLM Test-Time Compute Optimally", §5.1;
search-and-learn's ``beam_search``): sample ``n`` first steps, keep the ``n / beam_width``
best by the step scorer, expand each into ``beam_width`` next steps, repeat; a solution that
ends is set aside, and the search stops when ``n`` solutions have ended or no step is left.

DVTS (Beeching et al. 2024, "Scaling test-time compute with open models"): the ``n`` samples
are split into ``n / beam_width`` independent subtrees; each subtree greedily keeps its best
of ``beam_width`` candidate steps, so the subtrees cannot collapse onto one prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metaloom.generator.types import Generator
from metaloom.ledger import Ledger
from metaloom.meta.helpers import positive, select_top
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.core import Search, SearchConfig, run_search
from metaloom.search.tree import Node


def best_open(search: Search, nodes: list[Node], k: int) -> list[Node]:
    """The ``k`` best-scoring open nodes of ``nodes`` (ties to the earlier); the other open
    ones are pruned."""
    open_ = search.open_nodes(nodes)
    keep = [open_[i] for i in select_top([n.score or 0.0 for n in open_], k)]
    search.tree.prune([n for n in open_ if n not in keep])
    return keep


def beam_loop(s: Search, n: int, beam_width: int, expand: Callable[[list[Node], list[int]], list[Node]]) -> None:
    """Step-level beam search with ``expand`` as the round (plain, or with lookahead)."""
    keep = max(1, n // beam_width)
    children = expand([s.tree.root], [n])
    while True:
        if len(s.finished()) >= n:
            s.stop = "finished"
            return
        beams = best_open(s, children, keep)
        if not beams:
            s.stop = "finished"
            return
        children = expand(beams, [beam_width] * len(beams))


@dataclass(frozen=True)
class Beams(SearchConfig):
    """The fields of the beam searches: ``n`` samples per round, ``beam_width`` per kept node."""

    n: int = 8
    beam_width: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("n", self.n)
        positive("beam_width", self.beam_width)


@dataclass(frozen=True)
class StepBeamSearch(Beams):
    """Step-level beam search (Snell et al. 2024): ``n`` beams in all, ``beam_width`` children per
    kept beam (``n // beam_width`` kept)."""

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "step_beam_search", prompt, generator, ledger,
                          lambda s: beam_loop(s, self.n, self.beam_width, s.step))


@dataclass(frozen=True)
class DVTS(Beams):
    """Diverse verifier tree search (Beeching et al. 2024): ``n // beam_width`` subtrees, each
    expanding ``beam_width`` candidates of its current step and keeping the best."""

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "dvts", prompt, generator, ledger, self.search)

    def search(self, s: Search) -> None:
        subtrees = max(1, self.n // self.beam_width)
        width = self.beam_width
        children = s.step([s.tree.root], [subtrees * width])
        groups = [children[i * width:(i + 1) * width] for i in range(subtrees)]
        for i, g in enumerate(groups):
            for c in g:
                c.extra["subtree"] = i
        while True:
            heads: list[Node] = []
            for g in groups:
                if not g:
                    continue
                best = g[select_top([c.score or 0.0 for c in g])[0]]
                s.tree.prune([c for c in g if c is not best])
                if best.state == "open":
                    heads.append(best)
            if not heads:
                s.stop = "finished"
                return
            children = s.step(heads, [width] * len(heads))
            groups = [children[i * width:(i + 1) * width] for i in range(len(heads))]
            for head, g in zip(heads, groups, strict=True):
                for c in g:
                    c.extra["subtree"] = head.extra["subtree"]
