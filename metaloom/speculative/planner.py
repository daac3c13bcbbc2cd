"""The cost model that decides how much to speculate: per step, the draft length (for token
trees the node budget), which drafter drafts, and 0 (no speculation) when nothing pays.

A step that verifies ``m`` drafted nodes over ``B`` live rows yields the rows' pending tokens
plus every accepted node, and costs a forward of ``B + m`` tokens (`VerifyCost`, measured once,
rescaled online by the plain steps' times: ``scale``), the drafter's own time (``d0 + d1 k``,
learned online per drafter), the loop's fixed time between steps (``gap``, observed) and, when
``m > 0``, what a drafted step spends beyond its forward: ``overhead`` (the acceptance over every
verified position, keeping the accepted nodes' KV, a tree's masks) and ``wide`` per second of the
verify's width (a wide forward's cost moves with the machine apart from a one-token step's;
both learned online from drafted steps' times against ``scale * c``, `fit_overhead`). The
planner maximises expected tokens per second of the step::

    rate(m) = (B + sum of a_i over the m kept nodes)
              / (scale * c(B + m) + [m > 0] (overhead + wide (c(B + m) - c(B))) + drafting + gap)

where ``a_i`` is the probability that the i-th node a drafter proposes is accepted (for a chain,
that at least i drafts are; for a tree, that node i lies on the accepted path), learned online
per drafter (`metaloom.speculative.acceptance`). This is SpecDec++'s stopping rule (Huang et
al. 2024, "SpecDec++: Boosting speculative decoding via adaptive candidate lengths": stop
drafting where the expected gain of one more token falls below its cost) and DySpec's budget
(Xiong et al. 2024, "DySpec: Faster speculative decoding with dynamic token tree structure":
keep the nodes most likely accepted) with the cost curve measured instead of assumed, as the
verify's cost on a CPU grows steeply with its width.

Acceptance is conditioned on the row's state, ``hot`` (its last verified draft kept at least one
token) or cold: a row copying its input (prompt lookup in an edit) keeps long drafts, a row that
just left the copy keeps none, and the two regimes alternate within one answer. The estimates are
counts decayed by `acceptance.DECAY` per observation, shrunk towards a geometric continuation of
the earlier nodes' rates (a node never verified is priced from the ones before it); nodes are priced
no higher than the nodes before them (a prefix of a draft is what can be kept). To keep learning
what it stopped doing, the planner verifies one node more than it would every `PROBE_EVERY`
steps, and tries a drafter (or draft length) it has dropped again; both intervals double each time
the trial does not win (`Probe`: the longer step kept nothing, the drafter's step was slower than
the plan it displaced), so on text where nothing is accepted the trials fade to one in `PROBE_MOST` steps.

What exploring may cost is bounded (`Budget`): a step drafts only while the time speculation has
lost against plain decoding stays within `SAFETY` of the decoding time, as a conservative bandit
explores only while its reward stays within a share of the baseline's (Wu et al. 2016,
"Conservative Bandits"); a drafter is asked only when its expected drafting time (and a draft
model's catch-up on the context) fits in the room left with one verified node, and a draft is
cut to what the budget could lose were all of it rejected. A step whose drafter proposed nothing
is charged its drafting alone: its forward was a plain step's, and its noise is not drafting's
loss. A draft model's catch-up on the context (a prefill of it, spent once before it drafts,
whether it then pays or not) is also held to `CATCH_UP_SHARE` of the plain steps its rows may
still take: the room may hold what another drafter gained, and under `auto` on
Qwen2.5-Coder-1.5B's grounded prompts prompt lookup's gains paid for the 0.5B draft model's
trial, a catch-up on 220 tokens that took 0.9 s of a prompt's 2.1 s, against 0.75 s for prompt
lookup alone (1.13x plain greedy against 2.0x; issue 47). A drafter whose observations only feed
what it learns (Token Recycling's table) is charged for them, and idles while the room would not
hold one node within `PROBE_EVERY` steps though it keeps paying (`Budget.held_for`'s ``spend``).
Optimistic first estimates, trials and probes all spend from it; steps that paid refill it. So
on text where nothing pays, speculation costs at most about `SAFETY` of plain decoding's time
(and one step) plus the planner's own bookkeeping, however the estimates mislead. While the room
cannot hold one node for a while, or a lone drafter pays at no length until its next probe, the
decode loop runs plain steps the drafters take no part in (`PlannedDrafter.plain_ahead`): the
bookkeeping of an undrafted step, 0.2-0.3 ms of a 5-6 ms SmolLM2 step on two CPU cores, is spent
only around the steps that may draft.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.speculative.cost import VerifyCost

PROBE_EVERY = 16  # steps between one-node-longer trials (and drafter trials) while they win
PROBE_MOST = 1024  # the longest interval between trials of a dropped drafter
CHEAP = 0.02  # drafting up to the cap costing less than this share of a step: draft it all, prune after
SAFETY = 0.01  # the share of decoding time that drafting steps may lose against plain steps (`Budget`)
ALLOWANCE = 0.5  # plain steps' time a fresh planner may lose before it has earned any (`Budget.room`)
WINDOW = 2048  # steps: the budget's memory (a long plain stretch does not bank a burst of trials)
CATCH_UP_SHARE = 0.05  # a draft model's catch-up on context: at most this share of the plain steps left (`amortised`)


@dataclass
class DraftCost:
    """A drafter's time per `propose`, learned online (moving averages): ``fixed`` seconds with
    nothing to draft (the planning alone), plus, when it is asked for k tokens, ``call`` once and
    ``per_token`` per token of its limit (a draft model's forwards). Once the limits it was asked
    for differ by a token or more (over the recent calls), the two are fitted by least squares on
    the calls' times; until then the whole time counts per token. Prompt lookup's time is its
    index's update, whatever its limit: counted per token it read 0.04-0.09 ms a token on
    SmolLM2, so that a draft of 10 seemed to cost a quarter of a step to make and the plans
    asked for 3 to 6 tokens where the copy went on (issue 47). Unknown parts count 0: a drafter
    is tried before it is judged."""

    fixed: float = 0.0
    per_token: float = 0.0
    fixed_samples: int = 0
    token_samples: int = 0
    call: float = 0.0
    # decayed sums over the drafted calls: weight, k, k^2, t, k t (t: a call's seconds beyond `fixed`)
    sums: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)

    def seconds(self, k: int) -> float:
        return self.fixed + (self.call + self.per_token * k if k > 0 else 0.0)

    def record(self, k: int, seconds: float, rate: float = 0.2) -> None:
        if k <= 0:
            self.fixed = seconds if self.fixed_samples == 0 else self.fixed + rate * (seconds - self.fixed)
            self.fixed_samples += 1
            return
        t = max(seconds - self.fixed, 0.0)
        keep = 1.0 - rate if self.token_samples else 0.0
        w, sk, skk, st, skt = (keep * x for x in self.sums)
        self.sums = (w + 1.0, sk + k, skk + k * k, st + t, skt + k * t)
        self.token_samples += 1
        w, sk, skk, st, skt = self.sums
        spread = skk / w - (sk / w) ** 2
        if spread >= 1.0:  # limits a token or more apart: a slope can be told from the level
            self.per_token = max((skt / w - (sk / w) * (st / w)) / spread, 0.0)
            self.call = max(st / w - self.per_token * sk / w, 0.0)
        else:
            self.per_token, self.call = (st / w) / (sk / w), 0.0


@dataclass(frozen=True)
class Timing:
    """What a step costs besides the verified nodes: the measured curve, its online ``scale``,
    the fixed seconds of every step (drafting done or planned, the loop's gap), and the
    ``overhead`` a step that verifies some node pays beyond its forward (the acceptance over
    every position, keeping the kept nodes' KV, a tree's masks: learned online)."""

    cost: VerifyCost
    scale: float
    fixed: float
    overhead: float = 0.0
    wide: float = 0.0  # a drafted step's seconds beyond scale * c, per second of c the nodes add (`fit_overhead`)

    def seconds(self, tokens: float) -> float:
        """A plain step of ``tokens`` rows (no node verified)."""
        return self.scale * self.cost.seconds_for(tokens) + self.fixed

    def drafted_at(self, rows: int, nodes: float) -> float:
        """A step of ``rows`` rows verifying ``nodes`` nodes besides (0: the plain step;
        fractional: an expected count, whose chance of verifying any is taken as min(nodes, 1)).
        In Python floats: the planner prices a step's few lengths right after a forward, when
        every numpy call starts with cold caches, and its numpy pricing cost a SmolLM2 step a few
        percent (issue 47)."""
        width = self.cost.seconds_for(rows + nodes)
        return ((self.scale + self.wide) * width - self.wide * self.cost.seconds_for(rows) + self.fixed
                + self.overhead * min(nodes, 1.0))

    def node(self, rows: int = 1) -> float:
        """What one verified node adds to a plain step of ``rows`` rows (the overhead with it)."""
        return self.drafted_at(rows, 1.0) - self.seconds(rows)


WIDE_POINTS = 8  # drafted steps before a slope is fitted (`fit_overhead`): two steps' noise is not a slope


def fit_overhead(points: Sequence[tuple[float, float]], apart: float) -> tuple[float, float]:
    """(overhead, wide) from drafted steps: ``points`` (x, r), x the table's seconds the step's
    nodes added to its rows' forward (c(width) - c(rows)), r the step's seconds beyond
    ``scale * c(width)``; fitted as r = overhead + wide x. Theil-Sen (Sen 1968): ``wide`` the
    median of the slopes between points whose x lie at least ``apart`` apart, the overhead the
    median of r - wide x. Both parts are there: a drafted step pays about the same beyond its
    forward whatever its width (proposing, accepting, rolling back), and a wide forward's share
    moves with the machine: on a 2-core VM a 12-token SmolLM2 verify took 12.6 ms for seconds,
    then 16.6 ms, while a one-token step moved by 5% (issue 47). One additive overhead fitted to
    5- to 11-token steps read 2.3 ms and priced a 2-token verify 20% of a step too high.
    Medians, as a step's noise has spikes of 30 ms. With fewer than `WIDE_POINTS` points, or
    none of them ``apart``, ``wide`` is 0 (a SmolLM2 step's noise of +-2 ms between two steps 1 ms
    of the curve apart read as slopes of -0.7 to 4.7)."""
    pts = list(points)
    slopes = [(r2 - r1) / (x2 - x1) for i, (x1, r1) in enumerate(pts) for x2, r2 in pts[i + 1:]
              if abs(x2 - x1) >= apart] if len(pts) >= WIDE_POINTS else []
    wide = statistics.median(slopes) if slopes else 0.0
    return statistics.median([r - wide * x for x, r in pts]) if pts else 0.0, wide


def prune(kept: Sequence[Sequence[float]], lengths: Sequence[int], rows: int, timing: Timing,
          extra: int = 0) -> list[int]:
    """How many of its drafted nodes each row verifies: ``kept[b]`` [>= lengths[b]] row b's node
    acceptance estimates (non-increasing), ``lengths[b]`` its drafted nodes, ``rows`` the live
    rows (each feeds its pending token). Nodes are taken best first across rows, as many as
    maximise the step's expected tokens per second; ``extra`` more per row (a probe)."""
    items = sorted((-float(kept[b][i]), i, b) for b in range(len(lengths)) for i in range(lengths[b]))
    best_m, best, gain = 0, (rows + 0.0) / timing.drafted_at(rows, 0.0), 0.0
    for m, (neg, _, _) in enumerate(items, start=1):  # in floats, as `Timing.drafted_at` says why
        gain += -neg
        rate = (rows + gain) / timing.drafted_at(rows, float(m))
        if rate > best:  # the first of equal rates: the fewest nodes
            best_m, best = m, rate
    out = [0] * len(lengths)
    for _, _, b in items[:best_m]:
        out[b] += 1
    return [min(n + extra, lengths[b]) if lengths[b] else 0 for b, n in enumerate(out)]


def plan_length(kept: Sequence[Sequence[float]], proposed: Sequence[Sequence[float]], limits: Sequence[int], rows: int,
                timing: Timing, draft: DraftCost, cap: int) -> tuple[int, float]:
    """Before drafting: the draft length k in [0, cap] (every row's limit, cut by ``limits[b]``)
    with the best expected rate, and that rate. Row b's node i counts with probability
    ``proposed[b][i]`` (it is drafted) times ``kept[b][i]`` (it is accepted); drafting costs
    ``draft.seconds(k)``. A drafter whose drafting is nearly free (`CHEAP`) drafts ``cap`` and
    lets `prune` choose among what it proposed."""
    # in Python floats (`Timing.drafted_at` says why), in numpy's order of the same operations
    gain = [0.0] * (cap + 1)
    width = [0.0] * (cap + 1)
    for b, limit in enumerate(limits):  # row b contributes its first min(k, limit) nodes
        g, w = [0.0], [0.0]  # the running sums of its first i nodes' expected acceptances and proposals
        for p, a in zip(proposed[b][:cap], kept[b][:cap], strict=False):
            g.append(g[-1] + float(p) * float(a))
            w.append(w[-1] + float(p))
        for k in range(cap + 1):
            n = min(k, limit, len(g) - 1)
            gain[k] += g[n]
            width[k] += w[n]
    best_k, best_rate = 0, -math.inf
    for k in range(cap + 1):
        rate = (rows + gain[k]) / (timing.drafted_at(rows, width[k]) + draft.fixed + draft.per_token * k)
        if rate > best_rate or k == 0:  # the first of equal rates
            best_k, best_rate = k, rate
    if cap and draft.seconds(cap) - draft.seconds(0) <= CHEAP * timing.scale * timing.cost.seconds_for(rows):
        best_k = cap
    return best_k, best_rate


@dataclass
class Budget:
    """What drafting may still lose (Wu et al. 2016, "Conservative Bandits": explore only while
    the cumulative reward stays within a share of the baseline's). The baseline is plain
    decoding: a step that drafted and yielded ``t`` tokens over ``r`` rows would have taken
    ``t / r`` plain steps. ``lost`` sums what drafting steps took beyond that (negative where
    speculation paid), ``elapsed`` the time of every step, both decayed over about `WINDOW`
    steps. The ``room`` left is ``SAFETY * elapsed + allowance - lost`` (``allowance``:
    `ALLOWANCE` plain steps, so that a fresh planner may try a short draft): a step drafts only while there is
    room, and verifies no more nodes than would fit in it were every one rejected
    (`PlannedDrafter.afford`), so ``lost`` never passes ``SAFETY * elapsed`` by more than the
    allowance and one step's drafting."""

    lost: float = 0.0
    elapsed: float = 0.0
    held: int = 0  # steps the budget kept from drafting (reported)
    trimmed: int = 0  # nodes it cut from drafts that did not fit (reported)
    deferred: int = 0  # steps whose drafting it cut to fit, a catch-up or a dear drafter's (reported)

    def room(self, allowance: float) -> float:
        return SAFETY * self.elapsed + allowance - self.lost

    def held_for(self, step: float, allowance: float, spend: float = 0.0) -> float:
        """About how many plain steps of ``step`` seconds must pass before there is room (0: there
        is), each also charged ``spend`` seconds (learners observing: `charge`); inf when the
        window can never earn it (a step's charges outrunning its 1%, say)."""
        if self.room(allowance) > 0:
            return 0.0
        keep = 1.0 - 1.0 / WINDOW
        earned = (SAFETY * (step + spend) - spend) * WINDOW  # what plain steps add to the room, over the window
        # after n plain steps: keep**n * (lost - SAFETY * elapsed) <= allowance + earned * (1 - keep**n)
        if earned + allowance <= 0:  # more than the window can ever earn
            return math.inf
        a = (earned + allowance) / (self.lost - SAFETY * self.elapsed + earned)
        return math.log(a) / math.log(keep)

    def charge(self, seconds: float) -> None:
        """Time spent outside any step's forward only to learn for later drafts: lost, as it is
        time plain decoding would not spend."""
        self.lost += seconds
        self.elapsed += seconds

    def record(self, seconds: float, plain: float | None = None) -> None:
        """A step of ``seconds``; ``plain``: what plain steps would have taken for its tokens
        (None: it drafted nothing, so it lost nothing)."""
        keep = 1.0 - 1.0 / WINDOW
        self.elapsed = keep * self.elapsed + seconds
        self.lost = keep * self.lost + (0.0 if plain is None else seconds - plain)


@dataclass
class Probe:
    """When to try a drafter the planner has not chosen lately: after ``interval`` steps, doubled
    (up to `PROBE_MOST`) each time a trial does not make it the planner's choice."""

    interval: int = PROBE_EVERY
    last: int = 0  # the step it last drafted

    def due(self, step: int) -> bool:
        return step - self.last >= self.interval

    def tried(self, step: int, won: bool) -> None:
        self.last = step
        self.interval = PROBE_EVERY if won else min(self.interval * 2, PROBE_MOST)
