"""The cost model in the decode loop: a drafter that asks the planner, each step, which of its
drafters drafts, how many tokens it may draft, and how many of them are verified.

`PlannedDrafter` wraps one drafter (``--speculative NAME``, the cost model on) or several
(``--speculative auto``: the planner picks the drafter as well). It is a `Drafter`, so the
decode loop runs it as any other: `PlannedState.propose` plans (`metaloom.speculative.planner`),
lets the chosen drafter propose, times it and keeps the nodes that pay; `observe` learns from the
verification what was accepted and what the step cost, and passes the verification on to every
drafter (each keeps its own state: a drafter not chosen this step still sees what the target
said, as Token Recycling and speculator heads need). An empty draft is a one-token step (the
tree of the pending token alone is the plain step, `LlamaModel.forward`), so choosing 0 costs
what plain decoding costs, plus the planner's arithmetic.

What the planner learns is kept across the batches and requests of one `PlannedDrafter`, as
Token Recycling keeps its matrix; `report` says what it chose (``--json``'s ``cost_model``).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.acceptance import COLD, Acceptance
from metaloom.speculative.cost import VerifyCost, measure_verify_cost
from metaloom.speculative.drafter import LEVELS, MAX_DRAFT, Drafter
from metaloom.speculative.planned_report import planned_report
from metaloom.speculative.planned_state import Choice, Outcome, PlannedState, as_chain, kept_paths
from metaloom.speculative.planner import (
    ALLOWANCE,
    CATCH_UP_SHARE,
    CHEAP,
    PROBE_EVERY,
    Budget,
    DraftCost,
    Probe,
    Timing,
    fit_overhead,
    plan_length,
    prune,
)

__all__ = ["Choice", "Outcome", "PlannedDrafter", "PlannedState", "as_chain", "kept_paths"]

OVERHEAD_WINDOW = 16  # drafted steps the overhead is fitted to (`PlannedDrafter.learn`, `fit_overhead`)
WIDE_APART = 0.25  # their widths' costs at least this many one-token steps apart to give a slope
AHEAD_MOST = 64  # the most steps `plain_ahead` promises before asking the budget again
REPRICE = 8  # steps a candidate's pricing is reused while no estimate changed (`PlannedDrafter._priced`)


class PlannedDrafter:
    """The cost model over ``candidates`` (drafter, most tokens a step each). ``cost``: a verify
    cost curve measured already (`measure_verify_cost`); None measures it on the first target."""

    def __init__(self, candidates: Sequence[tuple[Drafter, int]], cost: VerifyCost | None = None,
                 name: str | None = None) -> None:
        if not candidates:
            raise InvalidParameter("candidates", [], "at least one drafter")
        for drafter, cap in candidates:
            if not isinstance(cap, int) or not 1 <= cap <= MAX_DRAFT:
                raise InvalidParameter("num_draft", cap, f"an integer in [1, {MAX_DRAFT}] for {drafter.name}")
        self.drafters = [d for d, _ in candidates]
        self.caps = [k for _, k in candidates]
        self.cost = cost
        self._name = name or (self.drafters[0].name if len(self.drafters) == 1 else "auto")
        self.lock = threading.Lock()
        self.reset()
        if cost is not None:  # measured up front: the feed rates too, so that no request pays for them
            self.measure_feeds()

    def measure_feeds(self) -> None:
        """What feeding each drafter's own model costs (a catch-up is priced at it), measured once."""
        for d in self.drafters:
            measure = getattr(d, "measure_feed", None)
            if measure is not None:
                measure()

    def reset(self) -> None:
        """Forget what was learned (acceptance, drafting and step times, choices); the measured
        verify cost stays."""
        self.acceptance = [Acceptance(k, getattr(d, "class_priors", ()))  # a drafter's priors per class, if any
                           for d, k in zip(self.drafters, self.caps, strict=True)]
        self.draft_costs = [DraftCost() for _ in self.caps]
        self.probes = [Probe() for _ in self.caps]
        self.extras = [Probe() for _ in self.caps]  # when each drafter next verifies one node more
        self.scale, self.gap, self.step = 1.0, 0.0, 0
        self.overhead = 0.0  # a drafted step's seconds beyond scale * c(width) (`Timing.overhead`)
        self.wide = 0.0  # and per second of c its nodes add (`Timing.wide`)
        # the last drafted steps' (c(width) - c(rows), seconds beyond scale * c(width)): `fit_overhead`
        self.residuals: deque[tuple[float, float]] = deque(maxlen=OVERHEAD_WINDOW)
        self.charged = 0.0  # learners' charges since the last step was learned from
        self.spend = 0.0  # their moving average over the steps they learned in (`idle`)
        self.ahead_steps = 0  # steps run plain without the drafters (`plain_ahead`; reported)
        self.quiet_until = 0  # the step a lone drafter's next probe is due, while no draft of it pays (`plain_ahead`)
        self.budget = Budget()  # what exploring may still lose against plain decoding
        self.version = 0  # bumped whenever an estimate a plan reads changes (`_priced` keeps plans until then)
        self.priced: tuple[tuple[tuple[int, ...], tuple[int, ...]], int, int, list[tuple[float, int, int]]] | None = None
        self.steps = [0] * len(self.caps)  # steps each drafter drafted (some node verified)
        self.verified = [0] * len(self.caps)
        self.kept = [0] * len(self.caps)
        self.histogram: dict[int, int] = {}  # nodes verified per row-step -> how often

    @property
    def name(self) -> str:
        return self._name

    @property
    def num_draft(self) -> int:
        return max(self.caps)

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> PlannedState:
        with self.lock:
            if self.cost is None:
                self.cost = measure_verify_cost(target, most=self.num_draft + 1)
            if self.step == 0:  # nothing learned yet: the step's usual time, not its best
                self.scale = self.cost.typical
        self.measure_feeds()  # where it was not measured at construction (each drafter keeps its own)
        states = [d.start(target, sampler, contexts, keys) for d in self.drafters]
        return PlannedState(self, states, [COLD] * len(contexts))

    # --- planning (under the lock: batches of one engine may run in threads) ----------------
    def timing(self, fixed: float = 0.0) -> Timing:
        assert self.cost is not None
        return Timing(self.cost, self.scale, self.gap + fixed, self.overhead, self.wide)

    def plan(self, hot: Sequence[int], limits: Sequence[int], catch_up: Sequence[float] | None = None,
             ahead: Sequence[int | None] | None = None) -> Choice:
        """The step's plan for rows in states ``hot`` allowed ``limits`` tokens; ``catch_up``: per
        candidate, the seconds it must spend feeding context before it drafts, or None; ``ahead``:
        per candidate, the most tokens its rows may still produce (None: unknown)."""
        rows = sum(1 for n in limits if n > 0)
        with self.lock:
            self.step += 1
            self.quiet_until = 0
            if rows == 0:
                return Choice(0, 0, False, False, 0.0)
            if catch_up is not None and ahead is not None:
                catch_up = self.amortised(catch_up, ahead, rows)
            room = self.budget.room(self.allowance())
            if room <= 0:  # drafting has lost its share: plain steps until earned back
                self.budget.held += 1
                return Choice(0, 0, False, False, 0.0)
            timing = self.timing()
            # what drafting may spend: the room less one verified node's time, without which
            # `afford` would verify nothing and the drafting would be lost for nothing
            room -= timing.node(rows)
            if len(self.caps) == 1 and self.cheap(0, timing, rows):  # draft all it may, prune after
                if not self.fits(0, self.caps[0], catch_up, room):  # not even one node, or a dear catch-up
                    self.budget.deferred += 1
                    return Choice(0, 0, False, False, 0.0)
                extra = self.extras[0].due(self.step)
                drafted = self.timing(self.draft_costs[0].seconds(self.caps[0]))  # as `keep` prices it
                if not extra and not self.may_pay(0, hot, limits, drafted, rows):  # `prune` would keep none:
                    # and so until its next probe, unless the step's time drifts: `plain_ahead`
                    self.quiet_until = self.extras[0].last + self.extras[0].interval
                    return Choice(0, 0, False, False, 0.0)  # not even asked, the plain step's cost
                return Choice(0, self.caps[0], extra, False, 0.0)
            plans = self._priced(hot, limits, rows, timing)
            if catch_up is not None and math.inf in catch_up:  # out of this request: never the plan
                # (an untried draft model is priced at its priors, and led every plan, deferred
                # step after step, while Token Recycling's drafts paid under `auto`; issue 47)
                plans = [(-math.inf, -c, 0) if catch_up[c] == math.inf else p for c, p in enumerate(plans)]
            rate, neg, k = max(plans)
            best = Choice(-neg, k, self.extras[-neg].due(self.step), False, rate)
            due = [c for c in range(len(plans)) if (c != best.candidate or best.k == 0) and self.probes[c].due(self.step)
                   and self.fits(c, self.trial_length(c, plans[c][2]), catch_up, room)]
            if due:  # the longest unseen first, of those whose drafting fits the room
                c = min(due, key=lambda i: self.probes[i].last)
                return Choice(c, self.trial_length(c, plans[c][2]), True, True, rate)
            k = best.k
            while k > 0 and not self.fits(best.candidate, k, catch_up, room):
                k -= 1
            if k < best.k:
                self.budget.deferred += 1
                return Choice(best.candidate, k, best.extra and k > 0, False, rate)
            if best.k == 0 and len(self.caps) == 1:  # a lone drafter that pays at no length: until its trial
                self.quiet_until = self.probes[0].last + self.probes[0].interval
            return best

    def trial_length(self, c: int, planned: int) -> int:
        """A trial of drafter ``c`` drafts its planned length, and at least two tokens where it may."""
        return max(planned, min(2, self.caps[c]))

    def amortised(self, catch_up: Sequence[float], ahead: Sequence[int | None], rows: int) -> list[float]:
        """``catch_up`` with each one dearer than `CATCH_UP_SHARE` of the plain steps its rows
        may still take (``ahead``) made infinite: never tried (a catch-up is spent up front,
        whether the drafter then pays or not; `metaloom.speculative.planner` says why)."""
        step = self.timing().seconds(rows)
        return [math.inf if n is not None and s > 0 and s > CATCH_UP_SHARE * n * step else s
                for s, n in zip(catch_up, ahead, strict=True)]

    def fits(self, c: int, k: int, catch_up: Sequence[float] | None, room: float) -> bool:
        """Whether drafting ``k`` tokens with drafter ``c`` fits in ``room`` (what the budget has
        left beyond one verified node): the drafting is spent whatever is accepted, its learned
        time and the seconds it must feed context first (``catch_up``)."""
        return self.draft_costs[c].seconds(k) + (0.0 if catch_up is None else catch_up[c]) < room

    def _priced(self, hot: Sequence[int], limits: Sequence[int], rows: int, timing: Timing) -> list[tuple[float, int, int]]:
        """Each candidate's best (rate, -index, length) under ``timing``. Pricing three drafters
        costs a few percent of a small model's step, and on text where nothing is drafted
        nothing it reads changes but the step time's slow drift: the plans are kept for the same
        rows until an estimate changes (``version``) or `REPRICE` steps pass."""
        key = (tuple(hot), tuple(limits))
        if self.priced is not None and self.priced[:2] == (key, self.version) and self.step - self.priced[2] < REPRICE:
            return self.priced[3]
        plans = []
        states = set(hot)
        for c, acc in enumerate(self.acceptance):
            kept = {h: acc.kept_rates(h) for h in states}
            proposed = {h: acc.proposal_rates(h) for h in states}
            k, rate = plan_length([kept[h] for h in hot], [proposed[h] for h in hot],
                                  [min(n, self.caps[c]) for n in limits], rows, timing, self.draft_costs[c],
                                  self.caps[c])
            plans.append((rate, -c, k))
        self.priced = (key, self.version, self.step, plans)
        return plans

    def idle(self, c: int) -> bool:
        """Whether drafter ``c`` will not draft within `PROBE_EVERY` steps and did not in the last
        as many: the budget has no room for one verified node for longer (`plan` holds or defers
        every drafter), or `auto` dropped it and its next trial is further away."""
        if self.cost is not None:
            timing = self.timing()
            # learning is charged: a learner idles unless the room holds a node soon though it
            # pays, and its own drafting with it, of all it may draft where that is cheap (what
            # `fits` asks: short of it, every step was deferred and charged, 94-111 steps of a
            # SmolLM2 request under Token Recycling)
            most = self.caps[c] if self.cheap(c, timing, 1) else 1
            need = self.allowance() - timing.node() - self.draft_costs[c].seconds(most)
            if self.budget.held_for(timing.seconds(1), need, self.spend) > PROBE_EVERY:
                return True
        probe = self.probes[c]
        return len(self.caps) > 1 and self.step - probe.last > PROBE_EVERY and \
            probe.last + probe.interval - self.step > PROBE_EVERY

    def plain_ahead(self, rows: int) -> int:
        """How many of the next steps of ``rows`` live rows are sure to be plain, the last of them
        not counted: the budget's room cannot hold one verified node before (`plan` holds or
        defers every drafter, probes and trials included), or a lone drafter none of whose drafts
        pays was not asked at the last step, and will not be until its next probe (its estimates
        move only with drafted steps; the step's time may drift meanwhile); 0 when unsure. The
        decode loop runs them as plain steps without the drafters (`PlannedState.plain_ahead`),
        and the last one as an undrafted step, so that every drafter sees the step before it
        drafts again. Without the second, a Jacobi step on free text that drafted nothing still
        paid 0.17 ms of a 4.5 ms SmolLM2 step for the planner and its observation (issue 47)."""
        with self.lock:
            if self.cost is None or rows <= 0:
                return 0
            timing = self.timing()
            n = self.budget.held_for(timing.seconds(rows), self.allowance() - timing.node(rows))
            if self.quiet_until:  # the steps before the probe's: plain, as the last plan was
                n = max(n, self.quiet_until - self.step - 1)
            return int(min(n, AHEAD_MOST)) - 1 if n > 1 else 0

    def skipped(self, seconds: float, rows: int) -> None:
        """A step `plain_ahead` let run as a plain step of ``seconds``: learned as `plan` and
        `learn` would learn an undrafted one (the budget's record, the scale, the step count)."""
        with self.lock:
            self.step += 1
            self.ahead_steps += 1
        self.learn(Choice(0, 0, False, False, 0.0), Outcome([COLD] * rows, [0] * rows, [0] * rows, [0] * rows,
                                                             [[] for _ in range(rows)], 0.0, seconds, rows))

    def charge(self, seconds: float) -> None:
        """Time spent only to learn (a ``learns_only`` drafter's observation), charged to the budget."""
        with self.lock:
            self.budget.charge(seconds)
            self.charged += seconds

    def allowance(self) -> float:
        """The budget's fixed room: `ALLOWANCE` plain steps."""
        return ALLOWANCE * self.timing().seconds(1)

    def afford(self, keep: Sequence[int], rows: int) -> list[int]:
        """``keep`` cut, from the longest row's tail (its least likely nodes), to what the budget
        has room for were every node rejected: the verify's extra time over a plain step (the
        drafting is spent already, whatever is verified; `fits` priced it before)."""
        with self.lock:
            room = self.budget.room(self.allowance())
            timing = self.timing()
            plain = timing.seconds(rows)
            extra = [timing.drafted_at(rows, float(m)) - plain for m in range(sum(keep) + 1)]  # ascending
            fits = bisect.bisect_right(extra, room) - 1  # the most nodes whose extra time fits
            out = list(keep)
            cut = sum(out) - max(fits, 0)
            self.budget.trimmed += max(cut, 0)
            for _ in range(cut):
                b = max(range(len(out)), key=lambda i: out[i])
                out[b] -= 1
            return out

    def cheap(self, c: int, timing: Timing, rows: int) -> bool:
        d = self.draft_costs[c]
        return d.seconds(self.caps[c]) - d.seconds(0) <= CHEAP * timing.scale * timing.cost.seconds_for(rows)

    def may_pay(self, c: int, hot: Sequence[int], limits: Sequence[int], timing: Timing, rows: int) -> bool:
        """Whether some draft of drafter ``c`` could be worth verifying in part: any m of its
        nodes, each priced at the best first-node estimate of the rows' states over every
        confidence class (an upper bound of what `prune` counts: estimates never rise along a
        draft), beat the plain step's rate under ``timing``. When none does, `prune` with that
        timing keeps nothing whatever is proposed, so the drafter need not propose. The caller
        passes the step's fixed time with the drafter's usual time for a whole draft in it (what
        `keep` passes `prune`, up to that time's noise)."""
        acc = self.acceptance[c]
        best = max(float(acc.kept_rates(h, level)[0]) for h in set(hot) for level in (None, *range(LEVELS)))
        most = sum(min(n, self.caps[c]) for n in limits)
        plain = (rows + best * 0.0) / timing.drafted_at(rows, 0.0)  # in floats: `Timing.drafted_at`
        return any((rows + best * m) / timing.drafted_at(rows, float(m)) > plain for m in range(1, most + 1))

    def keep(self, choice: Choice, hot: Sequence[int], lengths: Sequence[int], rows: int, drafting: float,
             levels: Sequence[int] | None = None) -> list[int]:
        """How many of each row's proposed nodes to verify (`prune`, with the drafting time spent),
        priced by each row's state and its draft's confidence class."""
        with self.lock:
            acc = self.acceptance[choice.candidate]
            classes = [(h, None if levels is None else levels[b]) for b, h in enumerate(hot)]
            kept = {c: acc.kept_rates(*c) for c in set(classes)}
            return prune([kept[c] for c in classes], lengths, max(rows, 1), self.timing(drafting), int(choice.extra))

    # --- learning ---------------------------------------------------------------------------
    def learn(self, choice: Choice, outcome: Outcome) -> None:
        with self.lock:
            c = choice.candidate
            assert self.cost is not None
            if self.charged > 0:  # the last step's learning (its learners observe after this is called)
                self.spend += 0.2 * (self.charged - self.spend) if self.spend else self.charged
                self.charged = 0.0
            live = max(outcome.width - sum(outcome.verified), 1)  # the rows that fed a pending token
            total = outcome.step + outcome.drafting + self.gap
            if choice.k > 0 and any(outcome.verified):  # against what plain steps would have taken for its tokens
                tokens = live + sum(len(k) for k in outcome.kept)
                self.budget.record(total, tokens / live * self.timing().seconds(live))
                self.version += 1
            elif choice.k > 0:  # asked, but no node verified: a plain step's forward; only the drafting is lost
                self.budget.record(total, total - outcome.drafting)  # (its timing noise is not)
                self.version += 1
            else:
                self.budget.record(total)
            self.draft_costs[c].record(choice.k, outcome.drafting)
            if outcome.step > 0 and choice.k > 0 and any(outcome.verified):
                # a drafted step: what it took beyond its forward's price (the forward's level is
                # the plain steps' to set), fitted over the last `OVERHEAD_WINDOW` by medians: a
                # drafted SmolLM2 step's lies between -2 and +6 ms of it (the step's noise), and a
                # moving average of them, clamped at 0, read 1-4 ms
                forward = self.cost.seconds_for(outcome.width)
                self.residuals.append((forward - self.cost.seconds_for(live), outcome.step - self.scale * forward))
                overhead, wide = fit_overhead(self.residuals, WIDE_APART * self.cost.seconds[0])
                # a wider verify never costs less than a narrower one
                self.overhead, self.wide = max(overhead, 0.0), max(wide, -self.scale / 2)
            elif outcome.step > 0:
                ratio = outcome.step / self.cost.seconds_for(outcome.width)
                ratio = min(max(ratio, self.scale / 3), self.scale * 3) if self.step > 1 else ratio
                self.scale += 0.2 * (ratio - self.scale)
            if choice.k == 0:  # a plain step: no row was allowed a node, so nothing else is learned
                self.histogram[0] = self.histogram.get(0, 0) + len(outcome.verified)
                return
            acc = self.acceptance[c]
            for b, (hot, allowed, proposed, verified) in enumerate(zip(outcome.hot, outcome.allowed, outcome.proposed,
                                                                       outcome.verified, strict=True)):
                acc.record_proposal(hot, allowed, proposed)
                acc.record(hot, verified, outcome.kept[b], None if outcome.levels is None else outcome.levels[b])
                self.histogram[verified] = self.histogram.get(verified, 0) + 1
                self.verified[c] += verified
                self.kept[c] += len(outcome.kept[b])
            drafted = any(outcome.verified)
            self.steps[c] += int(drafted)
            if choice.extra and drafted:  # a probe that kept nothing backs off (a drafter nothing of which is accepted)
                self.extras[c].tried(self.step, any(outcome.kept))
            if choice.trial:  # a trial wins when the step beat the plan it displaced
                total = outcome.step + outcome.drafting + self.gap
                tokens = len(outcome.hot) + sum(len(k) for k in outcome.kept)
                self.probes[c].tried(self.step, total > 0 and tokens / total >= choice.rate)
            elif drafted:
                self.probes[c].tried(self.step, True)

    def learn_gap(self, seconds: float) -> None:
        with self.lock:
            self.gap += 0.2 * (seconds - self.gap) if self.step > 2 else seconds - self.gap

    def report(self) -> dict[str, Any]:
        """What the planner measured and chose (``--json``: ``cost_model``; `planned_report`)."""
        with self.lock:
            return planned_report(self)
