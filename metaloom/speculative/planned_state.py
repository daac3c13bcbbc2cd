"""The cost model's state in the decode loop: `PlannedState`, the `DraftState` that
`PlannedDrafter.start` makes for a batch. Each step it asks the planner for a plan, lets the
chosen drafter propose, keeps the nodes that pay (`PlannedDrafter.keep`, cut to the exploration
budget's room by `PlannedDrafter.afford`), and after the verify tells the planner what happened
(`Outcome`) and feeds every drafter what the target said. `Choice` is a step's plan and
`Planner` what the state asks of the planner. Also `kept_paths` and `as_chain`: a verified
tree's accepted path, and a tree step seen as the chain it kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from metaloom.models.forward import Ledgers
from metaloom.speculative.acceptance import COLD, HOT
from metaloom.speculative.drafter import Draft, DraftState, Verified


@dataclass(frozen=True)
class Choice:
    """A step's plan: ``candidate`` drafts up to ``k`` tokens a row. ``extra``: verify one node
    more per row than the estimates say (to learn past them: every `PROBE_EVERY` steps, an
    interval that doubles while such steps keep nothing, as `Probe`'s);
    ``trial``: the candidate is tried because it was not chosen lately (`Probe`); ``rate``: the
    expected tokens per second of the best plan, which a trial is judged against."""

    candidate: int
    k: int
    extra: bool
    trial: bool
    rate: float


class Planner(Protocol):
    """What a `PlannedState` asks of its planner (`metaloom.speculative.planned.PlannedDrafter`)."""

    def plan(self, hot: Sequence[int], limits: Sequence[int], catch_up: Sequence[float] | None = None,
             ahead: Sequence[int | None] | None = None) -> Choice: ...

    def keep(self, choice: Choice, hot: Sequence[int], lengths: Sequence[int], rows: int, drafting: float,
             levels: Sequence[int] | None = None) -> list[int]: ...

    def afford(self, keep: Sequence[int], rows: int) -> list[int]: ...

    def learn(self, choice: Choice, outcome: Outcome) -> None: ...

    def learn_gap(self, seconds: float) -> None: ...

    def idle(self, c: int) -> bool: ...

    def plain_ahead(self, rows: int) -> int: ...

    def skipped(self, seconds: float, rows: int) -> None: ...

    def charge(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class Outcome:
    """One step as the planner learns from it, per row: its state when planned, the tokens the
    drafter was allowed and proposed, the nodes verified and the ones kept (node indices); and
    the seconds of drafting and of the step after it (forward, acceptance, emission), with the
    step's forward width."""

    hot: list[int]
    allowed: list[int]
    proposed: list[int]
    verified: list[int]
    kept: list[list[int]]
    drafting: float
    step: float
    width: int
    levels: tuple[int, ...] | None = None  # each row draft's confidence class (`Draft.levels`)


class PlannedState:
    """A batch's drafting state under the cost model: each drafter's own state, each row's
    `HOT`/`COLD` state, and the plan of the step in flight."""

    def __init__(self, planner: Planner, states: list[DraftState], hot: list[int]) -> None:
        self.planner = planner
        self.states = states
        self.hot = hot
        # the step in flight: its plan, per row the tokens allowed, proposed and kept, the drafting
        # seconds, when the draft was handed over, and the draft's confidence classes
        self.pending: tuple[Choice, list[int], list[int], list[int], float, float, tuple[int, ...] | None] | None = None
        self.done_at: float | None = None  # when the last step's observation ended
        self.needs_hidden = any(bool(getattr(s, "needs_hidden", False)) for s in states)
        self.caching = [s for s in states if hasattr(s, "cache")]  # read each step by the loop's memory measure
        self.empty: Draft | None = None  # the draft of a step nothing is drafted for (frozen: shared)
        self.catch_ups = [getattr(s, "catch_up", None) for s in states]  # drafters that feed context before drafting
        self.aheads = [getattr(s, "ahead", None) for s in states]  # and the tokens their rows may still produce
        self.learners = [i for i, s in enumerate(states) if getattr(s, "learns_only", False)]
        self.ahead = 0  # steps `plain_ahead` has promised plain and not yet run

    @property
    def cache(self) -> Any:
        """A draft model's own cache (the decode loop charges its KV memory)."""
        return next((c for s in self.caching if (c := s.cache) is not None), None)

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        start = time.perf_counter()
        if self.done_at is not None:
            self.planner.learn_gap(start - self.done_at)
        catch_up = ahead = None
        if any(self.catch_ups):
            catch_up = [f(contexts) if f else 0.0 for f in self.catch_ups]
            ahead = [g(contexts) if g else None for g in self.aheads]
        choice = self.planner.plan(self.hot, limits, catch_up, ahead)
        allowed = [min(n, choice.k) for n in limits]
        # nothing allowed: no drafter is asked (each returns nothing for limits of 0, and the
        # indexes that prompt lookup builds as it proposes catch up on the next proposal)
        if choice.k == 0:  # the shared empty draft, as it is: nothing to prune or afford
            now = time.perf_counter()
            self.pending = (choice, allowed, list(allowed), list(allowed), now - start, now, None)
            return self.nothing(len(contexts))
        draft = self.states[choice.candidate].propose(contexts, allowed, ledger)
        drafting = time.perf_counter() - start
        proposed = [min(int(n), a) for n, a in zip(draft.lengths.tolist(), allowed, strict=True)]
        rows = sum(1 for n in limits if n > 0)
        keep = (self.planner.keep(choice, self.hot, proposed, rows, drafting, draft.levels) if any(proposed)
                else [0] * len(proposed))
        if any(keep):
            keep = self.planner.afford(keep, rows)
        now = time.perf_counter()  # choosing what to verify counts as drafting: the plain step does neither
        self.pending = (choice, allowed, proposed, keep, now - start, now, draft.levels)
        if not any(keep):  # the step verifies nothing: the plain step's empty draft, nothing to build
            return self.nothing(len(contexts))
        lengths = torch.as_tensor(keep, dtype=torch.long, device=draft.lengths.device)
        return Draft(draft.tokens, lengths, draft.probs, draft.parents)

    def nothing(self, rows: int) -> Draft:
        """The draft of a step that verifies no node (shared: drafts are frozen)."""
        if self.empty is None or self.empty.lengths.shape[0] != rows:
            self.empty = Draft.from_lists([[] for _ in range(rows)])
        return self.empty

    def plain_ahead(self, rows: int) -> bool:
        """Whether this step can be a plain step the drafters do not take part in: the planner
        is sure it will not draft in it nor in the next (`PlannedDrafter.plain_ahead`), and every
        learner is idle (none would observe it). Such a step is reported with `skipped`."""
        if self.ahead <= 0:  # none promised: ask, unless a learner would observe the step
            if self.learners and not all(self.planner.idle(i) for i in self.learners):
                return False
            self.ahead = self.planner.plain_ahead(rows)
            if self.ahead <= 0:
                return False
        self.ahead -= 1
        return True

    def skipped(self, seconds: float, rows: int) -> None:
        """A step `plain_ahead` allowed ran as a plain step of ``seconds``."""
        self.planner.skipped(seconds, rows)
        self.done_at = time.perf_counter()  # the next step's gap starts here, not at the last observation

    def observe(self, verified: Verified) -> None:
        now = time.perf_counter()
        proposer = -1
        if self.pending is not None:
            choice, allowed, proposed, keep, drafting, after, levels = self.pending
            # the drafter whose nodes were verified; none on a step that verified nothing, so that
            # a lone learner the budget holds idles too (its table updates, charged every step,
            # had kept the budget from ever earning back a node: Token Recycling on SmolLM2)
            proposer = choice.candidate if any(keep) else -1
            kept = [k if n else [] for k, n in zip(kept_paths(verified), keep, strict=True)] if any(keep) \
                else [[] for _ in keep]
            rows = sum(1 for n in allowed if n > 0) or len(keep)
            self.planner.learn(choice, Outcome(list(self.hot), allowed, proposed, keep, kept, drafting, now - after,
                                               rows + sum(keep), levels))
            for b in range(len(keep)):
                if keep[b]:
                    self.hot[b] = HOT if kept[b] else COLD
            self.pending = None
        tree = verified.draft.parents is not None
        chain = as_chain(verified) if tree and len(self.states) > 1 else verified
        for i, state in enumerate(self.states):  # a chain drafter sees a tree step as the chain it kept
            learner = getattr(state, "learns_only", False)
            if learner and i != proposer and self.planner.idle(i):
                continue  # only its table would learn, and it will not draft soon (Token Recycling: a topk a step)
            began = time.perf_counter()
            state.observe(verified if i == proposer or not tree else chain)
            if learner:  # learning for drafts to come is exploring too: the budget pays for it
                self.planner.charge(time.perf_counter() - began)
        self.done_at = time.perf_counter()

    def select(self, rows: Sequence[int]) -> PlannedState:
        out = PlannedState(self.planner, [s.select(rows) for s in self.states], [self.hot[r] for r in rows])
        out.done_at = self.done_at
        return out

    def join(self, other: DraftState) -> PlannedState:
        assert isinstance(other, PlannedState)
        out = PlannedState(self.planner, [a.join(b) for a, b in zip(self.states, other.states, strict=True)],
                           self.hot + other.hot)
        out.done_at = self.done_at
        return out


def kept_paths(verified: Verified) -> list[list[int]]:
    """Each row's kept node indices: the first ``accepted`` of a chain; for a tree the path its
    emitted tokens walk (siblings are distinct). Read to the host once."""
    draft = verified.draft
    accepted = [int(a) for a in verified.accepted.tolist()]
    if draft.parents is None:
        return [list(range(a)) for a in accepted]
    tokens = verified.tokens.tolist()
    out = []
    for tree, n, row in zip(draft.trees(), accepted, tokens, strict=True):
        path, node = [], -1
        for token in row[:n]:
            node = next(c for c in tree.children(node) if tree.tokens[c] == token)
            path.append(node)
        out.append(path)
    return out


def as_chain(verified: Verified) -> Verified:
    """A tree step as the chain it accepted: the path's tokens as the draft, and the logits and
    hidden states of the pending token and the path's nodes in block order, so that a chain
    drafter reading ``logits[:, :accepted + 1]`` or ``hidden[:, accepted]`` (Jacobi, heads) sees
    what it would after a chain step."""
    draft = verified.draft
    b = verified.logits.shape[0]
    accepted = verified.accepted.tolist()
    width = max(accepted, default=0) + 1
    index = torch.zeros(b, width, dtype=torch.long)
    for r, path in enumerate(kept_paths(verified)):
        index[r, 1:len(path) + 1] = torch.as_tensor([n + 1 for n in path], dtype=torch.long)
    index = index.to(verified.logits.device)
    rows = torch.arange(b, device=index.device)[:, None]
    hidden = None if verified.hidden is None else verified.hidden[rows, index.to(verified.hidden.device)]
    chain = Draft(verified.tokens[:, :width - 1].to(draft.tokens.device), verified.accepted.to(draft.lengths.device))
    return Verified(draft=chain, logits=verified.logits[rows, index], accepted=verified.accepted,
                    tokens=verified.tokens[:, :width], hidden=hidden, pending=verified.pending)

