"""Beam search and diverse (group) beam search over the `LanguageModel` protocol.

Batched over prompts and beams: every live beam of every prompt is one row of one forward per
step, and beams are reordered by forking the cache rows (`KVCache.fork`). Beam scores are sums
of the log-probabilities the logits pipeline produces (`Sampler.process` on its greedy path:
penalties -> logit bias -> constraint mask -> log-softmax); a finished hypothesis is ranked by
``sum / length ** length_penalty`` with ``length`` the generated tokens, end-of-sequence
included (as transformers does).

Termination follows transformers' `early_stopping` (Wu et al. 2016 for the length penalty):

- ``True``: a prompt (group) is done once it holds ``beams`` finished hypotheses;
- ``False`` (default): also done when the best live beam, scored at its current length, cannot
  beat the worst kept hypothesis (a heuristic);
- ``"never"``: the same test at the best length it could still reach (``max_tokens`` when
  ``length_penalty > 0``) — exact, slower.

Diverse beam search (Vijayakumar et al. 2016, "Diverse Beam Search", Hamming diversity): the
beams form ``num_beam_groups`` groups searched one after the other at each step; a group's
candidates lose ``diversity_penalty`` times the number of times earlier groups chose the same
token at this step. As in the paper the penalty only steers selection; a beam's score stays its
log-probability (transformers adds the penalty into the score).

A candidate whose row finishes (end-of-sequence, stop string, ``max_tokens``) becomes a
hypothesis only if it ranks among the group's best ``group_size`` candidates; otherwise it is
dropped, and the best unfinished candidates keep the beam slots (2 * group_size are examined).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from metaloom.constrain import Constraint, batch_mask
from metaloom.decode.memory import beyond_bytes, charge_peak, held_bytes
from metaloom.decode.prefill import release_cache
from metaloom.decode.rows import RowState, emit
from metaloom.decode.select import most_likely
from metaloom.decode.specs import BeamParams
from metaloom.ledger import Ledger
from metaloom.models.forward import charged_forward
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState

T = TypeVar("T")


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam. ``logprobs`` are the raw model log-probabilities of ``tokens``;
    ``score`` is the length-penalised pipeline score beams are ranked by."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    score: float
    finish_reason: str
    group: int = 0
    stop_reason: str | int | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None  # as `Completion.top_logprobs`

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class _Beam:
    row: RowState
    score: float  # sum of pipeline log-probabilities
    source: int  # cache row it extends
    cursor: Constraint | None


def _penalised(score: float, length: int, alpha: float) -> float:
    return score / (length ** alpha)


@dataclass
class _Group:
    """Finished hypotheses of one (prompt, group), best first, at most ``size``."""

    size: int
    hyps: list[Hypothesis] = dataclasses.field(default_factory=list)
    done: bool = False

    def add(self, h: Hypothesis) -> None:
        self.hyps.append(h)
        self.hyps.sort(key=lambda x: -x.score)
        del self.hyps[self.size:]

    def settle(self, best_live: float | None, length: int, params: BeamParams, max_tokens: int) -> None:
        """Decide whether the group can stop (see the module docstring)."""
        if best_live is None:
            self.done = True
            return
        if len(self.hyps) < self.size:
            return
        if params.early_stopping is True:
            self.done = True
            return
        alpha = params.length_penalty
        reach = max_tokens if params.early_stopping == "never" and alpha > 0 else length
        self.done = _penalised(best_live, reach, alpha) <= self.hyps[-1].score


def _select(lp: torch.Tensor, raw: torch.Tensor, beams: list[_Beam], diversity: torch.Tensor | None,
            params: BeamParams, group: _Group, gid: int, tops: list[Any] | None = None) -> list[_Beam]:
    """One group's step: rank ``beams``' continuations, record finished ones, return the new
    live beams (at most group_size). lp, raw [R, V]: pipeline and raw log-probabilities;
    ``tops``: each cache row's most likely tokens, for rows that record them."""
    size, vocab = group.size, lp.shape[-1]
    rows = torch.tensor([b.source for b in beams], dtype=torch.long, device=lp.device)
    total = lp[rows] + torch.tensor([b.score for b in beams], dtype=lp.dtype, device=lp.device)[:, None]  # [n, V]
    ranked = total if diversity is None else total - diversity[None, :]
    values, index = torch.topk(ranked.flatten(), min(2 * size, ranked.numel()))
    scores = total.flatten()[index].tolist()
    raws = raw[rows[index // vocab], index % vocab].tolist()
    out: list[_Beam] = []
    for rank, (value, flat) in enumerate(zip(values.tolist(), index.tolist(), strict=True)):
        if value == float("-inf"):
            break
        parent, token = beams[flat // vocab], flat % vocab
        row = parent.row.fork()
        score = scores[rank]
        cursor = parent.cursor.fork() if parent.cursor is not None else None
        top = tops[parent.source][:row.top_k] if tops is not None and row.top_k else None
        emit(row, token, raws[rank], None, cursor, top)
        if row.done:
            if rank < size:
                group.add(Hypothesis(tuple(row.tokens), tuple(row.logprobs), row.text,
                                     _penalised(score, len(row.tokens), params.length_penalty), row.finish_reason or "stop", gid,
                                     row.stop_reason, tuple(row.top) if row.top_k else None))
            continue
        out.append(_Beam(row, score, parent.source, cursor))
        if len(out) == size:
            break
    return out


def beam_search(model: LanguageModel, cache: KVCache, logits: torch.Tensor, sampler: Sampler,
                rows: Sequence[RowState], params: BeamParams, ledger: Ledger, *, state: SamplingState | None = None,
                cursors: Sequence[Constraint | None] | None = None) -> list[list[Hypothesis]]:
    """`beam_steps` run to its end: the hypotheses of each prompt, best first."""
    return finish(beam_steps(model, cache, logits, sampler, rows, params, ledger, state=state, cursors=cursors))


def finish(steps: Generator[None, None, T]) -> T:
    """Run a stepwise search (a generator that pauses after each forward) to its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def beam_steps(model: LanguageModel, cache: KVCache, logits: torch.Tensor, sampler: Sampler,
               rows: Sequence[RowState], params: BeamParams, ledger: Ledger, *, state: SamplingState | None = None,
               cursors: Sequence[Constraint | None] | None = None) -> Generator[None, None, list[list[Hypothesis]]]:
    """Beam search for B prompts at once, pausing (``yield``) after each forward so that a
    caller can interleave it with other work (the server runs beams beside its decode loop);
    the hypotheses are the generator's return value. Closing it early frees the cache.

    ``cache`` holds the B prefilled prompts, ``logits`` [B, V] their next-token logits;
    ``sampler`` has one row per prompt with greedy parameters (its penalties, bias and the
    constraint mask shape the beam scores); ``state`` is ``sampler.start(prompts)`` (needed by
    penalties); ``rows`` are fresh `RowState`s carrying each prompt's ``max_tokens``, stop
    strings and end-of-sequence ids; ``cursors`` one constraint cursor per prompt (or None),
    forked per beam. Returns, per prompt, up to ``params.beams`` hypotheses, best first (fewer
    only when fewer sequences have non-zero probability).
    """
    b_count = len(rows)
    groups = [[_Group(params.group_size) for _ in range(params.num_beam_groups)] for _ in range(b_count)]
    # live beams per prompt and group; every group starts from the prompt's row with score 0
    live = [[[_Beam(rows[b].fork(), 0.0, b, None if cursors is None else cursors[b])] for _ in range(params.num_beam_groups)]
            for b in range(b_count)]
    owner = list(range(b_count))  # prompt of each cache row
    # KV held (kv_bytes_peak): the prompts' slots, shared by all their beams, counted once; past
    # them each step counts the distinct slots of the beams (forked beams share their past), a
    # beams-by-generated-tokens `np.unique`, small beside the forward
    prompts = held_bytes(cache)
    prompt_lengths = np.asarray(cache.lengths.tolist(), dtype=np.int64)
    charge_peak(ledger, prompts)
    high = prompts or 0
    if state is None:
        state = sampler.start()
    held = [cache]  # the cache of the moment (beams fork it): released however the search ends
    try:
        return (yield from _steps(model, held, logits, sampler, rows, params, ledger, state, cursors, groups, live,
                                  owner, (prompts, prompt_lengths, high)))
    finally:
        release_cache(held[0])


def _steps(model: LanguageModel, held: list[KVCache], logits: torch.Tensor, sampler: Sampler, rows: Sequence[RowState],
           params: BeamParams, ledger: Ledger, state: SamplingState, cursors: Sequence[Constraint | None] | None,
           groups: list[list[_Group]], live: list[list[list[_Beam]]], owner: list[int],
           memory: tuple[int | None, np.ndarray, int]) -> Generator[None, None, list[list[Hypothesis]]]:
    """`beam_steps`' loop; ``held[0]`` is the cache of the moment; ``memory``: the prompts' KV
    bytes, their lengths and the peak so far (kv_bytes_peak)."""
    b_count = len(rows)
    cache = held[0]
    prompts, prompt_lengths, high = memory
    step = 0
    while True:
        step += 1
        row_sampler = sampler.select(owner)
        mask = None
        if cursors is not None:
            by_row: list[Constraint | None] = [None] * len(owner)
            for beam in (beam for groups_b in live for beams in groups_b for beam in beams):
                by_row[beam.source] = beam.cursor
            mask = batch_mask(by_row, logits.shape[-1], logits.device)
        lp = row_sampler.process(logits, state, mask=mask)
        raw = torch.log_softmax(logits.float(), dim=-1)  # as `select.raw_logprobs`
        k = max(r.top_k for r in rows)
        tops = most_likely(logits, k) if k else None
        ledger.charge(output_tokens=len(owner))
        for b in range(b_count):
            diversity = torch.zeros(lp.shape[-1], device=lp.device) if params.num_beam_groups > 1 else None
            for g, group in enumerate(groups[b]):
                if group.done:
                    live[b][g] = []
                    continue
                chosen = _select(lp, raw, live[b][g], diversity, params, group, g, tops)
                group.settle(max((c.score for c in chosen), default=None), step, params, rows[b].max_tokens)
                live[b][g] = [] if group.done else chosen
                if diversity is not None:
                    for c in live[b][g]:
                        diversity[c.row.tokens[-1]] += params.diversity_penalty
        order = [beam for b in range(b_count) for beams in live[b] for beam in beams]
        if not order:
            break
        sources = [beam.source for beam in order]
        index = torch.as_tensor(sources, dtype=torch.long, device=logits.device)
        tokens = torch.tensor([beam.row.tokens[-1] for beam in order], dtype=torch.long, device=logits.device)
        owner = [owner[s] for s in sources]
        for i, beam in enumerate(order):  # beam i now lives in cache row i
            beam.source = i
        if sources != list(range(len(owner))) or len(sources) != int(cache.lengths.shape[0]):
            old, cache = cache, cache.fork(sources)  # the native cache forks without copying keys
            held[0] = cache
            release_cache(old)
        state = sampler.select(owner).advance(state.select(sources), tokens, lp[index])
        logits = charged_forward(model, tokens[:, None], cache, ledger)[:, -1]
        if prompts is not None:
            beyond = beyond_bytes(cache, prompt_lengths[owner])
            if beyond is None or prompts + beyond > high:
                high = prompts + (beyond or 0)
                charge_peak(ledger, None if beyond is None else high)
        yield
    return [sorted((h for group in groups[b] for h in group.hyps), key=lambda h: -h.score) for b in range(b_count)]
