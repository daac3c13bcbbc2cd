"""Lookahead search (Snell et al. 2024, "Scaling LLM Test-Time Compute Optimally", §5.1):
step-level beam search whose candidate steps are judged by looking ahead. From each new
step, ``k`` more steps are rolled out at temperature 0 (stopping early where the solution
ends) and the step scorer's score at the end of the rollout becomes the step's score. The
rollouts are not kept in the tree (each node records its lookahead text and tokens); their
cost is the round's. ``k = 0`` is plain step-level beam search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion, Generator
from metaloom.ledger import Ledger
from metaloom.meta.types import Result
from metaloom.score.protocols import Prompt
from metaloom.search.beam import Beams, beam_loop
from metaloom.search.core import Search, run_search
from metaloom.search.tree import Node


@dataclass(frozen=True)
class Lookahead(Beams):
    """Lookahead search (Snell et al. 2024): step-level beam search (``n`` beams, ``beam_width``
    children per kept beam) scoring each step by a ``k``-step greedy rollout."""

    k: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise InvalidParameter("k", self.k, "an integer >= 0 (steps to look ahead)")

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        return run_search(self, "lookahead", prompt, generator, ledger, self.search)

    def expand(self, s: Search, parents: list[Node], widths: list[int]) -> list[Node]:
        s.begin_round(parents)
        children = s.expand(parents, widths)
        tails = roll_ahead(s, children, self.k, self.delimiter)
        scored = [c for c in children if c.finish != "budget"]
        if scored:
            partials = [s.tree.texts(c) + [t.text for t in tails[c.id]] for c in scored]
            values = s.last_scores(partials)
            for c, v in zip(scored, values, strict=True):
                c.step_score = v
                if tails[c.id]:
                    c.extra["lookahead"] = "".join(t.text for t in tails[c.id])
                    c.extra["lookahead_tokens"] = sum(len(t.token_ids) for t in tails[c.id])
            s.rescore(scored)
        s.score_finished(children)
        s.end_round()
        return children

    def search(self, s: Search) -> None:
        beam_loop(s, self.n, self.beam_width, lambda parents, widths: self.expand(s, parents, widths))


def roll_ahead(s: Search, children: list[Node], steps: int, delimiter: Sequence[str]) -> dict[int, list[Completion]]:
    """Each open child's greedy rollout of up to ``steps`` more steps (outside the tree), by
    node id: one generator call a step for all that are still going."""
    tails: dict[int, list[Completion]] = {c.id: [] for c in children}
    rolling = [c for c in children if c.state == "open"]
    for _ in range(steps):
        if not rolling:
            break
        new = s.rollout_step(rolling, [tails[c.id] for c in rolling], temperature=0.0)
        # a rollout ends where its solution would: not at a delimiter
        rolling = [c for c, step in zip(rolling, new, strict=True)
                   if step.finish_reason == "stop" and step.stop_reason in delimiter]
    return tails
