"""What the cost model knows of a drafter's acceptance: per row state (``hot``: the row's last
verified draft kept at least one token; cold) and per node, decayed counts of the nodes verified
and kept, and estimates shrunk towards coarser ones (`rates`, `Acceptance`). The planner
(`metaloom.speculative.planner`) prices drafts with them.

A drafter that gives its drafts confidence classes (`Draft.levels`: prompt lookup's matched
length) may also give each class a prior (``class_priors``: the first node's acceptance and the
ratio of each next node's to its predecessor's), counted as `CLASS_PRIOR_WEIGHT` observations of
each state. Without, every class starts at `PRIOR`, and a request's first drafts are priced
alike whatever they matched: a fresh planner per request (`metaloom bench speculative`) ran
prompt lookup on SmolLM2's grounded prompts at 1.25x plain greedy, one that kept what earlier
requests taught it at 1.33x (issue 47).
"""

from __future__ import annotations

from collections.abc import Sequence

from metaloom.speculative.drafter import LEVELS

PRIOR = 0.5  # prior acceptance of a first drafted node, before any observation
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior
DECAY = 0.98  # per observed row-step: about the last 50 count
HOT, COLD = 1, 0
CLASS_PRIOR_WEIGHT = 2.0  # observations a drafter's class prior counts as, per row state


def rates(tried: Sequence[float], kept: Sequence[float], prior: float = PRIOR,
          base: Sequence[float] | None = None) -> list[float]:
    """Each node's acceptance estimate [N] from decayed counts: node i's ``kept / tried``
    shrunk by `PRIOR_WEIGHT` pseudo-observations towards ``base[i]`` (a coarser estimate) or,
    without one, towards node i-1's estimate times the ratio of the last two (``prior`` for the
    first); never above node i-1's."""
    out = []
    prev, ratio = 1.0, prior
    for i in range(len(tried)):
        toward = prev * ratio if base is None else float(base[i])
        est = min((float(kept[i]) + PRIOR_WEIGHT * toward) / (float(tried[i]) + PRIOR_WEIGHT), prev)
        ratio = est / prev if prev > 0 else 0.0
        out.append(est)
        prev = est
    return out


def _decayed(counts: list[float], n: int) -> list[float]:
    """``counts`` decayed by `DECAY`, then one more for each of its first ``n`` entries."""
    return [c * DECAY + 1.0 if i < n else c * DECAY for i, c in enumerate(counts)]


class Acceptance:
    """One drafter's decayed counts, per row state (`HOT`, `COLD`) and node index: verified and
    kept nodes (`rates`), and offered and proposed ones (how often the drafter proposes a node
    i when allowed to: prompt lookup has nothing to copy at times, heads stop when unsure).
    Kept nodes are also counted per confidence class of the draft (`Draft.levels`), whose
    estimates shrink towards the pooled counts of their class and the less sure ones
    (`_class_base`); ``priors`` (a drafter's ``class_priors``) are counted in as observations.
    The counts are Python floats: they are updated and read every step right after a forward,
    when each numpy call on these few entries cost more than the arithmetic (issue 47)."""

    def __init__(self, most: int, priors: Sequence[tuple[float, float]] = ()) -> None:
        self.most = most
        slots = 2 * (LEVELS + 1)  # per state: all classes, then each class
        self.tried = [[0.0] * most for _ in range(slots)]
        self.kept = [[0.0] * most for _ in range(slots)]
        self.offered = [[0.0] * most for _ in range(2)]
        self.proposed = [[0.0] * most for _ in range(2)]
        self._rates: dict[tuple[str, int], list[float]] = {}  # estimates since the last record
        for level, (first, ratio) in enumerate(priors[:LEVELS]):  # the drafter's class priors, as observations
            curve = [CLASS_PRIOR_WEIGHT * first * ratio ** i for i in range(most)]
            for hot in (COLD, HOT):
                for slot in (self.slot(hot), self.slot(hot, level)):
                    self.tried[slot] = [t + CLASS_PRIOR_WEIGHT for t in self.tried[slot]]
                    self.kept[slot] = [k + c for k, c in zip(self.kept[slot], curve, strict=True)]

    @staticmethod
    def slot(hot: int, level: int | None = None) -> int:
        return hot * (LEVELS + 1) + (0 if level is None else 1 + level)

    def record(self, hot: int, verified: int, kept: Sequence[int], level: int | None = None) -> None:
        """A row verified nodes ``0 .. verified - 1`` (a draft of class ``level``) and kept the
        nodes ``kept``."""
        if verified <= 0:
            return
        n = min(verified, self.most)
        self._rates.clear()
        for slot in {self.slot(hot), self.slot(hot, level)}:
            self.tried[slot] = _decayed(self.tried[slot], n)
            row = [c * DECAY for c in self.kept[slot]]
            for i in kept:
                if i < n:
                    row[i] += 1
            self.kept[slot] = row

    def record_proposal(self, hot: int, allowed: int, proposed: int) -> None:
        n = min(allowed, self.most)
        if n <= 0:
            return
        self._rates.clear()
        self.offered[hot] = _decayed(self.offered[hot], n)
        self.proposed[hot] = _decayed(self.proposed[hot], min(proposed, n))

    def kept_rates(self, hot: int, level: int | None = None) -> list[float]:
        slot = self.slot(hot, level)
        if ("kept", slot) not in self._rates:
            self._rates["kept", slot] = rates(self.tried[slot], self.kept[slot], base=self._class_base(hot, level))
        return self._rates["kept", slot]

    def _class_base(self, hot: int, level: int | None) -> list[float] | None:
        """What confidence class ``level``'s estimates shrink towards: the counts of its class
        and every less sure one pooled, never a surer class's. Classes are ordered (a longer
        n-gram match is kept more often), and shrunk towards all classes together a class not
        yet verified took the surer ones' rate: after prompt lookup's 3-token matches had been
        kept, a first 1-token match (13% of its first drafts kept on SmolLM2's grounded prompts,
        84% after 3-token ones) was priced at 0.75 a node and verified 7 to 10 of them, none
        kept, a few times a request (issue 47). The surest class with any record (its drafts',
        or its prior's) still shrinks towards its state's estimate over all classes."""
        if level is None:
            return None
        if not any(any(self.tried[self.slot(hot, c)]) for c in range(level + 1, LEVELS)):
            return self.kept_rates(hot)
        pooled = [self.slot(hot, c) for c in range(level + 1)]
        return rates([sum(self.tried[q][i] for q in pooled) for i in range(self.most)],
                     [sum(self.kept[q][i] for q in pooled) for i in range(self.most)])

    def proposal_rates(self, hot: int) -> list[float]:
        if ("proposed", hot) not in self._rates:
            self._rates["proposed", hot] = rates(self.offered[hot], self.proposed[hot], prior=1.0)
        return self._rates["proposed", hot]
