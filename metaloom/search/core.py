"""What every tree search shares: the common configuration (`SearchConfig`), one batched
expansion round (`Search.expand`: the whole frontier in one generator call, the new steps in
one step-scorer call), the choice of the final answer, and the tree in the trace.

A step is the text up to and including the next delimiter (default a blank line, Snell et
al. 2024 and search-and-learn): expanding a node asks the generator to continue its partial
solution exactly (`Request.prefix`, the path's token ids) with the delimiters as stop
strings kept in the output. Where the generator cannot continue token ids, the rendered
prompt plus the path's text is sent instead (the seam may tokenise differently).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from metaloom.errors import BudgetExceeded, InvalidParameter, ScorerFailed
from metaloom.generator.types import Completion, Generator, Request, render
from metaloom.ledger import Ledger, Usage
from metaloom.meta.helpers import Run, budget_event, component, ensure, guarded, positive, reseed
from metaloom.meta.helpers import score as helpers_score
from metaloom.meta.types import Result
from metaloom.meta.voting import decide
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.protocols import Prompt, Scorer, StepScorer, as_chat
from metaloom.search.aggregate import aggregate, check_aggregation
from metaloom.search.tree import Node, Tree

SELECTIONS = ("score", "vote", "weighted_vote")


def search_sampling() -> SamplingParams:
    """Diverse steps (search-and-learn samples steps at temperature 0.8); ``max_tokens`` is the
    whole solution's token limit, across its steps."""
    return SamplingParams(temperature=0.8, max_tokens=512)


@dataclass(frozen=True)
class SearchConfig:
    """Fields every tree search takes.

    ``step_scorer`` scores each new step (`metaloom.score`: a PRM, an LLM judge, rollouts, an
    exact checker); ``aggregation`` turns a path's step scores into its score ("last", "min",
    "product", "mean"). ``delimiter``: the stop strings that end a step (a custom split is
    a different stop string, e.g. ``("\\nStep ",)``). ``step_tokens`` caps one step,
    ``params.max_tokens`` the whole solution, ``max_depth`` the number of steps. ``select``
    picks the answer among finished solutions: the best "score", a majority "vote" over
    extracted answers, or a "weighted_vote" (each solution votes with its score; needs an
    ``extractor``, as do both votes). ``final_scorer``: an outcome verifier (a `Scorer`, e.g.
    the countdown answer checker) that scores each solution as it finishes; its score becomes
    the finished node's score (a step scorer judges steps, not whether a solution that stopped
    answered the question). It costs one more scorer call in the rounds where solutions finish."""

    step_scorer: StepScorer
    params: SamplingParams = field(default_factory=search_sampling)
    delimiter: tuple[str, ...] = ("\n\n",)
    step_tokens: int = 128
    max_depth: int = 24
    aggregation: str = "last"
    select: str = "score"
    extractor: Extractor | None = None
    final_scorer: Scorer | None = None

    def __post_init__(self) -> None:
        component("step_scorer", self.step_scorer, StepScorer,
                  "a StepScorer instance (registered: prm, judge, rollout, countdown, game24)")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        ensure(isinstance(self.delimiter, tuple) and len(self.delimiter) > 0
               and all(isinstance(d, str) and d for d in self.delimiter), "delimiter", self.delimiter,
               "one or more non-empty stop strings")
        positive("step_tokens", self.step_tokens)
        positive("max_depth", self.max_depth)
        check_aggregation(self.aggregation)
        ensure(self.select in SELECTIONS, "select", self.select, f"one of {SELECTIONS}")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)
        component("final_scorer", self.final_scorer, Scorer, "None or a Scorer instance", optional=True)
        if self.select != "score" and self.extractor is None:
            raise InvalidParameter("select", self.select, "'score', or a vote together with an extractor")


class Search:
    """One search in progress: the tree, the round counter and the run record."""

    def __init__(self, config: SearchConfig, name: str, run: Run, generator: Generator, prompt: Prompt) -> None:
        self.config = config
        self.name = name
        self.run = run
        self.generator = generator
        self.prompt = prompt
        self.tree = Tree()
        self.round = 0
        self.stop: str | None = None
        self.exact = "prefix" in generator.capabilities.features
        self.base = None if self.exact else render(generator, prompt)
        self._round_start: Usage | None = None
        self._round_parents: list[int] = []
        self._round_children: list[int] = []
        # node id -> members of the population it stands for (particle filtering's copies of one
        # particle drawn several times); a finished node votes that many times, 1 where absent
        self.copies: dict[int, int] = {}

    # --- one round: generate, then score -------------------------------------------------

    def step(self, parents: Sequence[Node], widths: Sequence[int], *, temperature: float | None = None) -> list[Node]:
        """Expand ``parents[i]`` into ``widths[i]`` children (one generator call for all of
        them), score every new step that is not cut by a budget (one scorer call), and record
        the round. Returns the children, in request order."""
        self.begin_round(parents)
        children = self.expand(parents, widths, temperature=temperature)
        self.score([c for c in children if c.finish != "budget"])
        self.score_finished(children)
        self.end_round()
        return children

    def begin_round(self, parents: Sequence[Node]) -> None:
        self._round_start = self.run.ledger.usage
        self._round_parents = [p.id for p in parents]
        self._round_children = []

    def end_round(self) -> None:
        if self._round_start is None:
            return
        entry = {"round": self.round, "expanded": self._round_parents, "children": len(self._round_children),
                 "usage": self.run.spent_since(self._round_start)}
        self.tree.rounds.append(entry)
        self.run.event("expand", round=self.round, parents=self._round_parents,
                       children=[{"id": n.id, "parent": n.parent.id if n.parent else None, "score": n.score,
                                  "finish": n.finish} for n in (self.tree.nodes[i] for i in self._round_children)],
                       usage=entry["usage"])
        self.round += 1
        self._round_start = None

    def params_for(self, node: Node, n: int, offset: int, temperature: float | None) -> SamplingParams:
        used = len(self.tree.tokens(node))
        p = dataclasses.replace(reseed(self.config.params, offset), n=n,
                                max_tokens=max(1, min(self.config.step_tokens, self.config.params.max_tokens - used)),
                                stop=tuple(dict.fromkeys((*self.config.params.stop, *self.config.delimiter))),
                                include_stop_str_in_output=True)
        return p if temperature is None else dataclasses.replace(p, temperature=temperature)

    def request(self, node: Node, params: SamplingParams, tail: Sequence[Completion] = ()) -> Request:
        """Continue the path to ``node`` (and the steps ``tail`` beyond it, not in the tree)."""
        if self.exact:
            return Request(self.prompt, params, prefix=self.tree.tokens(node) + tuple(t for c in tail for t in c.token_ids))
        return Request(f"{self.base}{''.join(self.tree.texts(node))}{''.join(c.text for c in tail)}", params)

    def rollout_step(self, nodes: Sequence[Node], tails: Sequence[list[Completion]], temperature: float) -> list[Completion]:
        """One more step after each (node, tail) in one generator call, outside the tree (the
        lookahead of `metaloom.search.lookahead`). Each tail grows by its new step."""
        requests = []
        for i, (node, tail) in enumerate(zip(nodes, tails, strict=True)):
            used = sum(len(c.token_ids) for c in tail)
            p = self.params_for(node, 1, self.round * 10_000 + 5_000 + i, temperature)
            p = dataclasses.replace(p, max_tokens=max(1, min(p.max_tokens, self.config.params.max_tokens
                                                              - len(self.tree.tokens(node)) - used)))
            requests.append(self.request(node, p, tail))
        outs = self.generator.generate(requests, ledger=self.run.ledger)
        new = [o[0] for o in outs]
        for tail, c in zip(tails, new, strict=True):
            tail.append(c)
        if any(c.finish_reason == "budget" for c in new):
            self.run.ledger.check()
        return new

    def expand(self, parents: Sequence[Node], widths: Sequence[int], *, temperature: float | None = None) -> list[Node]:
        """The generator call of a round. Children cut by a budget are recorded (finish
        "budget") before the budget stop is raised."""
        if len(parents) != len(widths):
            raise InvalidParameter("widths", widths, f"one width per parent ({len(parents)})")
        asked = [(p, w) for p, w in zip(parents, widths, strict=True) if w > 0]
        if not asked:
            return []
        base = self.round * 10_000
        requests = [self.request(p, self.params_for(p, w, base + 100 * i, temperature)) for i, (p, w) in enumerate(asked)]
        outs = self.generator.generate(requests, ledger=self.run.ledger)
        children: list[Node] = []
        for (parent, _), samples in zip(asked, outs, strict=True):
            used = len(self.tree.tokens(parent))
            for c in samples:
                child = self.tree.add(parent, c, self.classify(parent, used, c), self.round)
                children.append(child)
                self._round_children.append(child.id)
        if any(c.finish == "budget" for c in children):
            self.run.ledger.check()  # names the limit
        return children

    def classify(self, parent: Node, used: int, c: Completion) -> str:
        """Why the new step ended, as a `Node.finish` (``used``: the tokens of the parent's path)."""
        if c.finish_reason == "stop":
            if isinstance(c.stop_reason, str) and c.stop_reason in self.config.delimiter:
                finish = "step"
            else:
                return "eos"  # end of sequence, a user stop string, or a completed constraint
        elif c.finish_reason == "length":
            finish = "step_length"
        else:
            return c.finish_reason  # budget, error, cancelled
        if used + len(c.token_ids) >= self.config.params.max_tokens:
            return "length"
        if parent.depth + 1 >= self.config.max_depth:
            return "max_depth"
        return finish

    def score(self, nodes: Sequence[Node]) -> None:
        """Score the new step of each node in one step-scorer call; set its step score and its
        path's aggregate."""
        if not nodes:
            return
        for node, s in zip(nodes, self.last_scores([self.tree.texts(n) for n in nodes]), strict=True):
            node.step_score = s
            node.score = aggregate(self.config.aggregation, self.tree.step_scores(node))

    def last_scores(self, partials: Sequence[Sequence[str]]) -> list[float]:
        """The step scorer's score of the last step of each partial solution, in one call. A
        scorer that raises, or answers in the wrong shape, is `ScorerFailed` naming it."""
        scorer = self.config.step_scorer
        try:
            out = scorer.score_steps(self.prompt, partials, ledger=self.run.ledger, last_only=True)
            lasts = [float(s[-1]) for s in out]
        except (BudgetExceeded, ScorerFailed):
            raise
        except Exception as exc:
            raise ScorerFailed(getattr(scorer, "name", type(scorer).__name__), exc) from exc
        if len(lasts) != len(partials) or not all(math.isfinite(s) for s in lasts):
            raise ScorerFailed(scorer.name, ValueError(f"returned {len(lasts)} step scores for {len(partials)} "
                                                       f"partial solutions, or a non-finite one: {lasts}"))
        return lasts

    def score_finished(self, nodes: Sequence[Node]) -> None:
        """With a ``final_scorer``: score the solutions among ``nodes`` that finished (one
        scorer call); the outcome score replaces their path score."""
        scorer = self.config.final_scorer
        done = [n for n in nodes if n.finished and n.finish != "budget"]
        if scorer is None or not done:
            return
        scores = helpers_score(self.run, scorer, self.prompt, [self.tree.completion(n) for n in done])
        for n, v in zip(done, scores, strict=True):
            n.extra["final_score"] = v
            n.score = v

    def rescore(self, nodes: Sequence[Node]) -> None:
        """Recompute the aggregate of nodes whose step score was set by hand (lookahead)."""
        for n in nodes:
            n.score = aggregate(self.config.aggregation, self.tree.step_scores(n))

    # --- the end -------------------------------------------------------------------------

    def open_nodes(self, nodes: Sequence[Node]) -> list[Node]:
        return [n for n in nodes if n.state == "open" and not n.finished]

    def finished(self) -> list[Node]:
        """The finished solutions still in the search (a pruned one is not a candidate)."""
        return [n for n in self.tree.nodes if n.finished and n.finish != "budget" and n.state != "pruned"]

    def finalize(self) -> None:
        """Record the finished solutions as candidates, choose the answer, put the tree in
        the trace. With no finished solution, the best scored partial one stands in (finish
        "length" or "budget"), so a budget stop still reports the most promising path."""
        self.end_round()  # a round a budget interrupted is still charged to the tree
        run, cfg = self.run, self.config
        done = sorted(self.finished(), key=lambda n: n.id)
        if not done:
            scored = [n for n in self.tree.nodes if n.score is not None]
            if scored:
                done = [max(scored, key=lambda n: (n.score, n.depth, -n.id))]
        partial = bool(done) and not done[0].finished
        for n in done:
            if n.id in self.copies:
                n.extra["copies"] = self.copies[n.id]
        for n in done:
            c = self.tree.completion(n)
            run.candidates.append(dataclasses.replace(c, finish_reason="budget") if partial and self.stop == "budget" else c)
        # a solution the budget stopped before it was scored is unscored (NaN; null in JSON), not 0.0
        run.scores.extend(n.score if n.score is not None else math.nan for n in done)
        if cfg.extractor is not None:
            run.answers.extend(cfg.extractor.extract(c.text) for c in run.candidates)
        best: Node | None = None
        if done:
            known = [s if not math.isnan(s) else -math.inf for s in run.scores]  # unscored ranks last
            if cfg.select == "score" or cfg.extractor is None:
                # without an outcome verifier a path score says how good the steps were, not that
                # the solution answered: one cut by the token or step limit ranks below every one
                # that ended on its own (a truncated game24 step with one valid operation scored
                # 1.0 and was chosen over real answers)
                ended = [cfg.final_scorer is not None or n.finish == "eos" for n in done]
                run.best_index = min(range(len(done)), key=lambda i: (not ended[i], -known[i], i))
            else:
                copies = [self.copies.get(n.id, 1) for n in done]
                weights = [k * (max(s, 0.0) if cfg.select == "weighted_vote" else 1.0) for s, k in zip(known, copies,
                                                                                                      strict=True)]
                decide(run, run.answers, weights, cfg.extractor)
            if run.best_index is not None:
                best = done[run.best_index]
                run.event("select", index=run.best_index, node=best.id, score=run.scores[run.best_index])
        seen = any(n.finish == "step" for n in self.tree.nodes)
        if not seen and len(self.tree.nodes) > 1:
            run.event("no_delimiter", delimiter=list(cfg.delimiter),
                      detail="no step ended with the delimiter: each step ran to the step token limit "
                             "and the search ended at the solution's token limit")
        run.event("tree", **self.tree.to_dict(strategy=self.name, aggregation=cfg.aggregation,
                                              delimiter=list(cfg.delimiter), best=None if best is None else best.id,
                                              stop=self.stop or "finished", delimiter_seen=seen))


def run_search(config: SearchConfig, name: str, prompt: Prompt, generator: Generator, ledger: Ledger,
               body: Callable[[Search], None]) -> Result:
    """Run ``body`` as a search: a budget stop or a failing scorer still reports the tree and
    the best finished solution so far (`metaloom.meta.helpers.guarded`)."""

    prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)

    def outer(run: Run) -> None:
        search = Search(config, name, run, generator, prompt)
        finalized(run, search, lambda: body(search))

    return guarded(ledger, outer)


class Finalizable(Protocol):
    """A tree in progress: why it stopped, and the trace event that reports it."""

    stop: str | None

    def finalize(self) -> None: ...


def finalized(run: Run, tree: Finalizable, grow: Callable[[], None]) -> None:
    """Run ``grow``; a budget stop or a failing scorer still finalizes ``tree`` (its stop reason
    set, the budget event before the tree: the trace ends with the tree, as on a normal finish)
    before the error goes on to `metaloom.meta.helpers.guarded`."""
    try:
        grow()
    except BudgetExceeded as exc:
        tree.stop = "budget"
        budget_event(run, exc)
        tree.finalize()
        raise
    except ScorerFailed:
        tree.stop = "scorer_failed"
        tree.finalize()
        raise
    tree.finalize()
