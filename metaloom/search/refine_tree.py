"""Refinement trees: verifier-guided refinement where every node is a whole candidate and its
children are refinements prompted with its feedback — Treefinement, after Aggarwal et al.
2024, "AlphaVerus: Bootstrapping Formally Verified Code Generation through Self-Improving
Translation and Treefinement".

Round 0 samples ``initial`` candidates (one request) and gets each one's verdict from the
feedback (failing tests, execution errors, a checker's message: `metaloom.score.feedback`).
Each later round spreads ``width`` refinements over the previous round's candidates that did
not pass, by REBASE's rule (Wu et al. 2024; `metaloom.search.rebase.rebase_widths`):

    W_j = Round(width · exp(s_j / T) / Σ_k exp(s_k / T))

with s_j the candidate's verifier score (the verdict's score, else 1/0 for pass/fail) and T
``temperature``: a low temperature refines the best-scored candidates, a high one spreads the
width evenly; a candidate given no refinement is pruned. All of a round's refinements are one
generator call. A child's prompt is the question, its parent's answer and the parent's
feedback (`metaloom.meta.refine.revision_prompt`) — as AlphaVerus refines a program given its
verifier errors, not the whole path — so prompts stay one answer long at any depth. The search
stops at the first candidate that passes (``stop_on_pass``), or after ``depth`` rounds of
refinement, or when no candidate is left to refine. The tree goes into the trace.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator, Request
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    Run,
    component,
    default_sampling,
    ensure,
    extract_all,
    guarded,
    positive,
    reseed,
    stop_if_budget,
)
from metaloom.meta.refine import REVISE, revision_prompt, verdict
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.feedback import CritiqueFeedback, Feedback
from metaloom.score.prompting import fill
from metaloom.score.protocols import Prompt, as_chat
from metaloom.search.core import finalized
from metaloom.search.rebase import rebase_widths
from metaloom.search.tree import Node, Tree


@dataclass(frozen=True)
class RefineTree:
    """A tree of refinements guided by verifier feedback, its width allocated by REBASE.

    ``initial`` first samples; ``width`` refinements per round over the previous round's
    failing candidates, allocated by softmax(score / ``temperature``); at most ``depth``
    rounds of refinement; stop at the first pass when ``stop_on_pass``. ``feedback=None`` is
    a prompted critique by the generator (intrinsic, pass/fail only: extrinsic feedback with a
    score, such as tests, is what the allocation is for). Candidates are all the nodes, in the
    order they were made; the chosen one is the first that passed, else the best-scored
    (deeper, then earlier, on ties). A candidate left unjudged (a pass ended the round, a
    budget stop) has a NaN score."""

    feedback: Feedback | None = None
    initial: int = 4
    width: int = 4
    depth: int = 3
    temperature: float = 0.1
    stop_on_pass: bool = True
    revise_template: str = REVISE
    params: SamplingParams = field(default_factory=default_sampling)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        ensure(self.feedback is None or (callable(self.feedback) and not isinstance(self.feedback, type)), "feedback",
               self.feedback, "None (a prompted critique) or a Feedback instance")
        positive("initial", self.initial)
        positive("width", self.width)
        ensure(isinstance(self.depth, int) and not isinstance(self.depth, bool) and self.depth >= 0, "depth",
               self.depth, "an integer >= 0 (0: the initial samples only)")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise InvalidParameter("temperature", self.temperature, "a number > 0 (REBASE's balance temperature)")
        ensure(isinstance(self.stop_on_pass, bool), "stop_on_pass", self.stop_on_pass, "true or false")
        ensure(isinstance(self.revise_template, str), "revise_template", self.revise_template, "a template string")
        ensure(fill(self.revise_template, "revise_template", feedback="")
               != fill(self.revise_template, "revise_template", feedback="x"),
               "revise_template", self.revise_template, "a template using {feedback}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        feedback: Feedback = self.feedback if self.feedback is not None else CritiqueFeedback(generator)

        def body(run: Run) -> None:
            grow = _Grow(self, run, generator, feedback, prompt)
            finalized(run, grow, grow.search)

        return guarded(ledger, body)


class _Grow:
    """One refinement tree in progress: the tree, each node's feedback message, the run."""

    def __init__(self, config: RefineTree, run: Run, generator: Generator, feedback: Feedback, prompt: Prompt) -> None:
        self.config, self.run, self.generator, self.feedback, self.prompt = config, run, generator, feedback, prompt
        self.tree = Tree()
        self.messages: dict[int, str] = {}  # node id -> the feedback on it
        self.passed: list[Node] = []
        self.stop: str | None = None

    def search(self) -> None:
        cfg = self.config
        frontier = self.expand([self.tree.root], [cfg.initial], 0)
        for r in range(1, cfg.depth + 1):
            failing = [n for n in frontier if n.state == "open"]
            if (self.passed and cfg.stop_on_pass) or not failing:
                break
            widths = rebase_widths([n.score if n.score is not None else 0.0 for n in failing], cfg.width, cfg.temperature)
            self.tree.prune([n for n, w in zip(failing, widths, strict=True) if w == 0])
            kept = [(n, w) for n, w in zip(failing, widths, strict=True) if w > 0]
            for n, w in kept:
                n.extra["width"] = w
            frontier = self.expand([n for n, _ in kept], [w for _, w in kept], r)
        self.stop = "passed" if self.passed and self.config.stop_on_pass else "finished"

    def expand(self, parents: list[Node], widths: list[int], round: int) -> list[Node]:
        """One generator call for all of the round's candidates, then each one's verdict."""
        cfg, run = self.config, self.run
        before = run.ledger.usage
        requests = [Request(self.prompt if p is self.tree.root else
                            revision_prompt(self.prompt, p.text, self.messages[p.id], cfg.revise_template),
                            dataclasses.replace(reseed(cfg.params, round * 10_000 + 100 * i), n=w))
                    for i, (p, w) in enumerate(zip(parents, widths, strict=True))]
        children: list[Node] = []
        try:
            outs = self.generator.generate(requests, ledger=run.ledger)
            for parent, samples in zip(parents, outs, strict=True):
                for c in samples:
                    node = self.tree.add(parent, c, c.finish_reason, round)
                    node.state = "finished" if c.finish_reason == "budget" else "open"  # a candidate stays refinable
                    children.append(node)
                    run.candidates.append(c)  # candidate i is node i + 1
            stop_if_budget(run, [run.candidates[n.id - 1] for n in children])
            self.judge(children, round)
        finally:  # the round's cost, its verdicts included, even when a budget cut it short
            self.tree.rounds.append({"round": round, "expanded": [p.id for p in parents], "children": len(children),
                                     "usage": run.spent_since(before)})
            run.event("expand", round=round, parents=[p.id for p in parents], children=[n.id for n in children],
                      usage=run.spent_since(before))
        return children

    def judge(self, children: list[Node], round: int) -> None:
        """Each new candidate's verdict, in order, up to the first pass when ``stop_on_pass``."""
        run = self.run
        for node in children:
            v = verdict(run, self.feedback, self.prompt, run.candidates[node.id - 1], round)
            node.step_score = node.score = v.score if v.score is not None else float(v.passed)
            node.extra["passed"] = v.passed
            self.messages[node.id] = v.message
            run.scores.append(node.score)
            if v.passed:
                node.state = "finished"
                self.passed.append(node)
                if self.config.stop_on_pass:
                    return

    def finalize(self) -> None:
        """Scores aligned with the candidates, the choice, the tree in the trace."""
        run, nodes = self.run, self.tree.nodes[1:]
        run.scores.extend([math.nan] * (len(run.candidates) - len(run.scores)))
        run.answers.extend(extract_all(self.config.extractor, run.candidates))
        best: Node | None = self.passed[0] if self.passed else None
        if best is None:
            scored = [n for n in nodes if n.score is not None]
            best = max(scored, key=lambda n: (n.score, n.depth, -n.id)) if scored else None
        if best is not None:
            run.best_index = best.id - 1
            run.event("select", index=run.best_index, node=best.id, score=best.score, passed=bool(self.passed))
        for n in nodes:
            n.extra["feedback"] = self.messages.get(n.id)
        run.event("tree", **self.tree.to_dict(strategy="refine_tree", best=None if best is None else best.id,
                                              stop=self.stop or "finished", temperature=self.config.temperature,
                                              width=self.config.width))
