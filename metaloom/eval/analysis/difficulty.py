"""Difficulty probes for compute-optimal selection (`metaloom.eval.analysis.select`): how hard
each problem is for the model, to bin problems by (Snell et al. 2024, section 3.2).

- ``agreement`` (`agreement_probe`, the default): the deployable one. The first ``k`` samples
  (draw order) of one pooled record of the problem, and the difficulty 1 − (largest answer
  class)/k: no ground truth is read, and what those k samples cost is charged to
  compute-optimal (a deployment runs the probe first).
- ``pass_rate`` (`pass_rate_probe`): Snell et al.'s *oracle* difficulty, the model's own pass
  rate on the problem, 1 − c/n over the n samples of the largest pool (their pass@1 from 2048
  samples, binned in quantiles). It reads the ground truth of every problem, the held-out
  ones included (only to bin them: the strategy chosen per bin is still chosen on the
  selection half alone), so it is an upper reference, not a policy one can run: no cost is
  charged for it, and the report says so.

Both read the same pooled record: majority vote with the largest pool first, then other votes,
then the rest (`probe_spec`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.curves import latest
from metaloom.eval.analysis.subsample import COSTS, subset_cost
from metaloom.eval.records import POOLED, Record
from metaloom.wiring.spec import parse_spec

VOTES = ("majority_vote", "weighted_vote")


@dataclass(frozen=True)
class Probe:
    """The difficulty probe: its ``description``, the ``spec`` read and ``k`` samples used; per
    problem its ``difficulty`` (0..1) and ``cost`` per `COSTS`."""

    description: str
    spec: str | None
    k: int
    difficulty: Mapping[str, float]
    cost: Mapping[str, Mapping[str, float]]


def _answer_groups(record: Record, first: int) -> list[Any]:
    sel = record.selection
    if sel is not None and sel.kind in VOTES and len(sel.groups) == len(record.candidates):
        return list(sel.groups[:first])  # the vote's own answer classes (equivalent answers merged)
    return [c.answer for c in record.candidates[:first]]


def disagreement(groups: Sequence[Any], k: int) -> float:
    """1 − (largest class among ``groups``)/k; None entries (no answer) agree with nobody."""
    counts: dict[Any, int] = {}
    for g in groups:
        if g is not None:
            counts[g] = counts.get(g, 0) + 1
    return 1.0 - max(counts.values(), default=0) / k


def probe_spec(records: Sequence[Record], problems: Sequence[str]) -> str | None:
    """A pooled spec every problem has, whose candidates carry answers: majority vote first,
    then other votes, then the rest; the largest pool first."""
    table = latest(records)
    want = set(problems)
    ranked = []
    for i, spec in enumerate(dict.fromkeys(r.strategy for r in records)):
        name = parse_spec(spec).name
        recs = [table[(p, spec)] for p in problems if (p, spec) in table]
        if name not in POOLED or len(recs) < len(want) or not any(c.answer is not None for r in recs for c in r.candidates):
            continue
        rank = 0 if name == "majority_vote" else 1 if name in VOTES else 2
        ranked.append((rank, -max(len(r.candidates) for r in recs), i, spec))
    return min(ranked)[3] if ranked else None


def agreement_probe(records: Sequence[Record], problems: Sequence[str], k: int = 4) -> Probe:
    """Difficulty from answer agreement among the first ``k`` samples of a pooled record (see
    the module docstring); no ground truth is read. A problem whose record has no candidates
    is hardest (1.0)."""
    if k < 1:
        raise InvalidParameter("probe_k", k, "an integer >= 1")
    spec = probe_spec(records, problems)
    if spec is None:
        zero = dict.fromkeys(COSTS, 0.0)
        return Probe("none: no pooled record with answers; one bin", None, 0,
                     dict.fromkeys(problems, 0.0), {p: zero for p in problems})
    table = latest(records)
    difficulty, cost = {}, {}
    for p in problems:
        r = table[(p, spec)]
        first = min(k, len(r.candidates))
        difficulty[p] = disagreement(_answer_groups(r, first), first) if first else 1.0
        cost[p] = subset_cost(r, range(first))
    return Probe(f"answer disagreement among the first {k} samples of {spec} "
                 "(1 - largest answer class / k; no ground truth); their cost is charged to compute-optimal",
                 spec, k, difficulty, cost)


def pass_rate_probe(records: Sequence[Record], problems: Sequence[str], k: int = 4) -> Probe:
    """Snell et al.'s oracle difficulty: 1 − (correct samples)/n over the whole pool of the
    probe spec's record (``k`` is not used: every sample is read). Ground truth is read and
    nothing is charged (see the module docstring). A problem whose record has no candidates is
    hardest (1.0)."""
    del k
    spec = probe_spec(records, problems)
    zero = dict.fromkeys(COSTS, 0.0)
    if spec is None:
        return Probe("none: no pooled record with answers; one bin", None, 0,
                     dict.fromkeys(problems, 0.0), {p: zero for p in problems})
    table = latest(records)
    difficulty = {}
    for p in problems:
        cands = table[(p, spec)].candidates
        difficulty[p] = 1.0 - sum(c.correct for c in cands) / len(cands) if cands else 1.0
    n = max(len(table[(p, spec)].candidates) for p in problems)
    return Probe(f"oracle difficulty: 1 - the pass rate of the {n} samples of {spec} (Snell et al.'s oracle bins: "
                 "reads the ground truth of every problem, the held-out ones included, to bin them; not a policy "
                 "one can deploy, and not charged)", spec, 0, difficulty, {p: zero for p in problems})


ProbeFn = Callable[[Sequence[Record], Sequence[str], int], Probe]
DIFFICULTIES: Mapping[str, ProbeFn] = {"agreement": agreement_probe, "pass_rate": pass_rate_probe}


def make_probe(difficulty: str, records: Sequence[Record], problems: Sequence[str], k: int = 4) -> Probe:
    """The probe named ``difficulty`` (`DIFFICULTIES`) over ``problems``."""
    if difficulty not in DIFFICULTIES:
        raise InvalidParameter("difficulty", difficulty, f"one of {sorted(DIFFICULTIES)}")
    return DIFFICULTIES[difficulty](records, problems, k)
