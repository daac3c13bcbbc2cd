"""What each sample of a sampling strategy cost, so smaller N can be read off the largest N.

A pooled strategy (majority vote, weighted vote, best-of-N, MBR) draws its N samples in one
request: the prompt is prefilled once and forked N ways, then every row decodes its own
tokens. A run with fewer samples would have paid the same prefill and only its own rows'
decoding, so a subset's cost is ``shared + Σ candidate costs`` where a candidate's FLOPs are
its own decode forwards, from the model's FLOP formula (`LanguageModel.flops`; linear, so a
batched step splits exactly by row): a row's first token is drawn from the prefill's logits
(shared by all rows: the prompt is prefilled once and forked), and each later token costs one
forward of the token before it, so a row of ``L`` tokens after a ``P``-token prompt feeds
``L - 1`` tokens at positions P .. P+L-2, attending P+1 .. P+L-1 keys, one logit row each.
A scorer that runs a model (an LLM judge, a reward model) is asked about every candidate, so
a run with fewer samples would have asked it fewer questions: the scorer's FLOPs (its "score"
events) are split over the candidates in proportion to their tokens and added to each
candidate's own cost — an attribution (a judge's question is the prompt, found in the prefix
cache after the first, plus the candidate, so its cost grows with the candidate's length), where
charging the whole scorer to every subset would make best-of-N with a judge look as dear at
N = 1 as at N = 32. ``shared`` is the rest of the run (the prefill, MBR's pairwise utilities):
at the full N the parts add up to the run's charged usage exactly. Without a formula (a remote
server) the sampling call's FLOPs are split by tokens. Seconds are split in proportion to
FLOPs: an attribution, not a measurement — a batch of 32 rows does not take 32 times one row's
time.

Memory is a peak, not a sum, and has no per-row formula: the run's ``kv_bytes_peak`` is split
by the KV each part holds when every sample is alive at once — the prompt's P slots, shared by
the forks, and each sample's own L - 1 (its last token is never fed) — so ``shared`` is
peak · P / (P + Σ (L_i - 1)) and sample i's share peak · (L_i - 1) / (P + Σ (L_i - 1)). At the
full N the parts add up to the run's peak; a subset's sum is what its samples would hold
decoded together. An attribution, like seconds: samples that finish early free their slots
before the others peak, and a scorer may set the peak with memory of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metaloom.eval.records import POOLED, Candidate, Selection
from metaloom.eval.tasks.base import Grade
from metaloom.meta.types import Result
from metaloom.score.answers import Extractor, classes

# (prompt tokens, generated tokens) -> FLOPs of that row's own decode forwards
RowFlops = Callable[[int, int], float]


def model_row_flops(model: Any) -> RowFlops:
    """`RowFlops` of a `LanguageModel` (its ``flops(new_tokens, attended, logit_rows)``)."""
    from metaloom.models.flops import attended_keys

    def row(prompt: int, tokens: int) -> float:
        fed = max(0, tokens - 1)  # the first token came from the shared prefill's logits
        return float(model.flops(new_tokens=fed, attended=attended_keys([prompt], [fed]), logit_rows=fed))

    return row


def _usage_of(result: Result, kind: str) -> Mapping[str, Any]:
    """The usage of the run's ``kind`` calls ("sample", "score"), summed from its trace events."""
    total: dict[str, float] = {}
    for e in result.trace:
        if e.kind == kind:
            for k, v in (e.data.get("usage") or {}).items():
                if isinstance(v, int | float):
                    total[k] = total.get(k, 0) + v
    return total


def kv_shares(result: Result) -> tuple[list[float | None], float | None]:
    """(each candidate's share of the run's peak KV bytes, the prompt's share); see the module
    docstring. A peak the run could not measure (a remote server) stays None."""
    usage = result.usage
    if "kv_bytes_peak" in usage.unknown:
        return [None] * len(result.candidates), None
    peak = float(usage.kv_bytes_peak)
    prompt = float(_usage_of(result, "sample").get("input_tokens", 0))
    own = [float(max(len(c.token_ids) - 1, 0)) for c in result.candidates]
    held = prompt + sum(own)
    if held <= 0:
        return [0.0] * len(own), peak
    return [peak * t / held for t in own], peak * prompt / held


def attribute(result: Result, row_flops: RowFlops | None) -> tuple[list[tuple[float | None, float]], dict[str, float | None]]:
    """((flops, seconds) of each candidate, shared usage {flops, seconds, input_tokens,
    cached_tokens, scorer_calls, kv_bytes_peak}); see the module docstring. FLOPs the run could
    not count (a server that reports none, without ``--model-params``) stay None: no
    attribution of an unknown. Each candidate's KV share is `kv_shares`'s (`candidates_of`)."""
    usage = result.usage
    kv_shared = kv_shares(result)[1]
    if "flops" in usage.unknown:
        share = [len(c.token_ids) for c in result.candidates]
        secs_unknown = [float(usage.seconds) * t / sum(share) if sum(share) else 0.0 for t in share]
        return ([(None, s) for s in secs_unknown],
                {"flops": None, "seconds": 0.0, "input_tokens": float(usage.input_tokens),
                 "cached_tokens": float(usage.cached_tokens), "scorer_calls": float(usage.scorer_calls),
                 "kv_bytes_peak": kv_shared})
    sampled = _usage_of(result, "sample")
    prompt = int(sampled.get("input_tokens", 0) + sampled.get("cached_tokens", 0))
    tokens = [len(c.token_ids) for c in result.candidates]
    flops_total = float(usage.flops)
    if row_flops is not None:
        own = [row_flops(prompt, t) for t in tokens]
    else:  # no formula: split the sampling call's FLOPs by tokens
        sample_flops = float(sampled.get("flops", 0.0))
        own = [sample_flops * t / sum(tokens) if sum(tokens) else 0.0 for t in tokens]
    scorer_flops = float(_usage_of(result, "score").get("flops", 0.0))
    if scorer_flops > 0 and tokens:
        weights = tokens if sum(tokens) else [1] * len(tokens)
        own = [f + scorer_flops * w / sum(weights) for f, w in zip(own, weights, strict=True)]
    if sum(own) > flops_total > 0:  # never attribute more than was charged
        own = [f * flops_total / sum(own) for f in own]
    seconds_total = float(usage.seconds)
    secs = [seconds_total * f / flops_total if flops_total else 0.0 for f in own]
    shared: dict[str, float | None] = {"flops": flops_total - sum(own), "seconds": max(0.0, seconds_total - sum(secs)),
              "input_tokens": float(usage.input_tokens), "cached_tokens": float(usage.cached_tokens),
              "scorer_calls": float(usage.scorer_calls), "kv_bytes_peak": kv_shared}
    return list(zip(own, secs, strict=True)), shared


def selection_of(kind: str, result: Result, extractor: Extractor | None, transform: str | None = None) -> Selection:
    """How ``kind`` picked in ``result``, enough to re-pick within any subset."""
    if kind not in POOLED:
        raise ValueError(f"not a pooled strategy: {kind}")
    if kind in ("majority_vote", "weighted_vote"):
        assert extractor is not None
        return Selection(kind, tuple(classes(list(result.answers), extractor)), transform)
    if kind == "mbr":
        texts = [a or "" for a in result.answers] if extractor is not None else [c.text for c in result.candidates]
        distinct = list(Counter(texts))
        event = next((e for e in result.trace if e.kind == "mbr"), None)
        matrix = tuple(tuple(float(x) for x in row) for row in (event.data.get("matrix") or ())) if event else ()
        return Selection(kind, tuple(distinct.index(t) for t in texts), None, matrix)
    return Selection(kind)


def candidates_of(result: Result, grades: Sequence[Grade], costs: Sequence[tuple[float | None, float]]) -> tuple[Candidate, ...]:
    scores = list(result.scores) if len(result.scores) == len(result.candidates) else [None] * len(result.candidates)
    kv = kv_shares(result)[0]
    return tuple(Candidate(text=c.text, tokens=len(c.token_ids), flops=f, seconds=s, answer=g.answer, correct=g.correct,
                           score=None if sc is None else float(sc), kv_bytes=m)
                 for c, g, (f, s), sc, m in zip(result.candidates, grades, costs, scores, kv, strict=True))
