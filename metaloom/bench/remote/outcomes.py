"""What a strategy run gives (`Outcome`), and the rows of the report: one per (system, strategy),
with accuracy, tokens, seconds per problem and the usage check (what the system charged against
what the server counted)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.bench.remote.metrics import COUNTERS

# (usage field charged, the `COUNTERS` key that counts the same thing)
CHECKED = (("output_tokens", "generation"), ("input_tokens", "prompt"), ("cached_tokens", "cached"))


@dataclass(frozen=True)
class Outcome:
    """One strategy run of one system on one problem. Token figures are what the system itself
    says it spent (metaloom: its ledger; optillm: its reported completion tokens, no prompt
    tokens); ``server`` is what the vLLM server counted meanwhile (None: no server involved)."""

    system: str
    strategy: str
    problem: int
    answer: str | None
    correct: bool
    seconds: float
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    samples: int | None = None  # samples the choice was made among (optillm drops cut-off ones)
    sample_accuracy: float | None = None  # share of those samples whose own answer is right
    server: dict[str, int] | None = None
    error: str | None = None
    # prompt tokens vLLM counts beyond the usage it returns: it runs a request for n samples as
    # n requests and counts the prompt of each; its usage (and the ledger) count it once
    fanout_tokens: int = 0


def usage_check(runs: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    """Per checked field, over the runs that have both figures: the sum charged, the sum the
    server counted, and how many runs differ. Prompt tokens are compared after adding each
    run's ``fanout_tokens`` (their sum is reported as ``fanout``)."""
    out: dict[str, dict[str, int]] = {}
    for charged_field, counter in CHECKED:
        known = [o for o in runs if o.server is not None and getattr(o, charged_field) is not None]
        if not known:
            continue
        extra = [o.fanout_tokens if charged_field == "input_tokens" else 0 for o in known]
        charged = [getattr(o, charged_field) for o in known]
        server = [o.server[counter] for o in known if o.server is not None]
        out[charged_field] = {"charged": sum(charged), "server": sum(server), "fanout": sum(extra), "runs": len(known),
                              "runs_differing": sum(a + e != b for a, e, b in zip(charged, extra, server, strict=True))}
    return out


def aggregate(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per (system, strategy), in order of first appearance. Accuracy is over every
    problem run (a failed run counts as wrong); tokens are summed where every successful run
    knows them; seconds are per problem over the successful runs."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.system, o.strategy), []).append(o)
    rows = []
    for (system, strategy), runs in groups.items():
        ok = [o for o in runs if o.error is None]
        secs = [o.seconds for o in ok]

        def total(name: str, ok: list[Outcome] = ok) -> int | None:
            values = [getattr(o, name) for o in ok]
            return sum(values) if values and None not in values else None

        per_sample = [o.sample_accuracy for o in ok if o.sample_accuracy is not None]
        servers = [o.server for o in ok if o.server is not None]
        rows.append({
            "system": system, "strategy": strategy, "problems": len(runs), "errors": len(runs) - len(ok),
            "accuracy": sum(o.correct for o in ok) / len(runs),
            "sample_accuracy": statistics.fmean(per_sample) if per_sample else None,
            "input_tokens": total("input_tokens"), "output_tokens": total("output_tokens"),
            "cached_tokens": total("cached_tokens"),
            "samples": total("samples"),
            "seconds_total": sum(secs), "seconds_median": statistics.median(secs) if secs else None,
            "seconds_min": min(secs) if secs else None, "seconds_max": max(secs) if secs else None,
            "server": ({k: sum(s[k] for s in servers) for k in COUNTERS} if servers and len(servers) == len(ok) else None),
            "usage_check": usage_check(ok),
            "first_error": next((o.error for o in runs if o.error is not None), None),
        })
    return rows
