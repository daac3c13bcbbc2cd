"""The one decode loop: rows join and leave a running batch between steps.

`DecodeBatch` holds the rows being decoded together, their KV cache, their sampling
parameters and state, their constraint cursors and RNGs. `admit` adds rows at any time
between steps: their prompts are prefilled (each distinct prompt once, then forked to its
samples; through the radix prefix cache when there is one), their first token is drawn, and
their cache rows, sampler rows, pipeline state and drafter state are appended to the batch's.
`step` advances every live row by one forward. Finished rows leave (their cache freed, their
generated tokens stored in the prefix cache) before the next step. `generate`, `stream`, the
server's continuous batching and tree search's expansions all drive this one loop.

A step, for every decoder:

1. (speculative decoding) each row's drafter proposes tokens after its pending token;
2. one forward over ``[pending, draft]`` per row (``valid`` right-pads rows of different
   draft lengths; a finished row still in the batch feeds nothing);
3. plain: `select.draw` one token per row; speculative: `select.verify` a prefix of each draft
   plus one token (a plain step is a speculative step with empty drafts, and takes the plain
   draw for speed);
4. `rows.emit` every new token (stop strings, end-of-sequence, constraint completion and
   ``max_tokens`` end a row exactly where they occur), roll the cache back past rejected
   drafts, charge each row's ledger.

Each ledger is also charged the most KV memory its rows held at once (``kv_bytes_peak``,
measured after every join and every forward, before a rejected draft is rolled back:
`metaloom.decode.memory.BatchMemory`).

Rows of different requests may belong to different ledgers: each ledger is charged for its own
rows (`metaloom.models.forward`), and a ledger over its budget ends only its own rows, with
finish "budget" and what they produced so far. Plain sampling, contrastive decoding and
classifier-free guidance (a `LockstepPair` as the model) and speculative decoding all run here;
beam search, which reorders rows every step, has its own loop (`metaloom.decode.beam`) on the
same rows, forward and emit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from metaloom.constrain import Constraint
from metaloom.decode.memory import BatchMemory
from metaloom.decode.prefill import release_cache
from metaloom.decode.rows import RowState, emit
from metaloom.decode.select import draw, most_likely, raw_logprobs, verify
from metaloom.decode.tree_verify import verify_tree
from metaloom.errors import BudgetExceeded, InvalidParameter, UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.forward import charged_forward_both
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.prefix.pool import PrefixCache
from metaloom.sampling.counter import KEY_BITS
from metaloom.sampling.params import SamplingParams
from metaloom.sampling.pipeline import Sampler, make_sampler
from metaloom.sampling.state import SamplingState
from metaloom.speculative import Speculative
from metaloom.speculative.drafter import Draft, DraftState
from metaloom.speculative.drafter import Verified as Observed


@dataclass
class NewRow:
    """One output row to admit. ``prompt``: every id the model reads before the output (the
    prompt, then the answer so far: its last ``prefix`` ids). Rows with equal ``group`` (the
    samples of one request) share one prefill and are charged its input tokens once; they
    share ``rng`` too. ``secondary``: the second stream's prompt for contrastive decoding or
    guidance (None: the same prompt); ``combine``: that row's combination parameters."""

    prompt: tuple[int, ...]
    params: SamplingParams
    ledger: Ledger
    prefix: int = 0
    rng: torch.Generator | None = None
    # the row's own random key (`metaloom.sampling.counter.row_key` of its seed and sample index;
    # default: fresh from the OS, so rows made without one never share their draws)
    key: int = field(default_factory=lambda: secrets.randbits(KEY_BITS))
    cursor: Constraint | None = None
    group: Hashable | None = None
    secondary: tuple[int, ...] | None = None
    combine: tuple[float, ...] = ()
    tag: Any = None
    # a row taken out of a batch and admitted again (a preempted row, recomputed): its state
    # carries on (tokens, text, stop-string search, penalties' counts); ``prompt`` then ends with
    # the tokens it generated, which the prefill recomputes; its input was charged when it first joined
    resume: RowState | None = None

    @property
    def room(self) -> int:
        """Tokens the row may still generate: ``max_tokens``, less what a resumed row made."""
        return self.params.max_tokens - (len(self.resume.tokens) if self.resume is not None else 0)

    @property
    def capacity(self) -> int:
        """Cache positions the row may fill: its prompt, then `room`."""
        return len(self.prompt) + self.room


def row_state(tokenizer: Tokenizer, spec: NewRow) -> RowState:
    """The decoding state a row starts with (or carries on with, when resumed)."""
    if spec.resume is not None:
        return spec.resume
    p = spec.params
    return RowState.start(tokenizer, p.max_tokens, stop=p.stop, eos_ids=frozenset() if p.ignore_eos else tokenizer.eos_token_ids,
                          include_stop=p.include_stop_str_in_output, top_k=p.top_logprobs,
                          context=spec.prompt[len(spec.prompt) - spec.prefix:] if spec.prefix else ())


@dataclass
class Row:
    """A row of the batch: what it was admitted with and its decoding state."""

    spec: NewRow
    state: RowState
    context: list[int] = field(default_factory=list)  # prompt then output, for drafters
    made: int = 0  # tokens it had generated when it joined (a resumed row's: they end its prompt)


# (representative rows of the groups, cache capacity, their ledgers) -> (cache, raw logits [G, V], scores [G, V])
Prefill = Callable[[Sequence[NewRow], int, list[Ledger]], tuple[KVCache, torch.Tensor, torch.Tensor]]


def _tops(rows: Sequence[Row], skip: Sequence[bool], raw: torch.Tensor) -> list[Any] | None:
    """Every row's most likely tokens after ``raw`` [B, ..., V] (as many as the most any live
    row asks for; each row keeps its own count), or None when no live row records them."""
    k = max((row.state.top_k for b, row in enumerate(rows) if not (skip and skip[b])), default=0)
    return most_likely(raw, min(k, raw.shape[-1])) if k > 0 else None


def prefill_groups(lengths: Sequence[int], overhead: int) -> list[list[int]]:
    """Split prompts of these ``lengths`` into prefill forwards of minimal total cost.

    A forward over several prompts pads each to the longest, so prompts of mixed lengths (a
    5-token question beside a 400-token passage) waste most of a single padded forward; every
    extra forward costs a fixed ``overhead`` (in token-equivalents: weights read, per-layer
    launches). With lengths sorted, a group's cost is ``overhead + size * longest``; dynamic
    programming over the sorted order finds the cheapest split (contiguous in that order is
    optimal: swapping a short prompt into a group of long ones never lowers its cost). Returns
    index lists into ``lengths``, each sorted, groups in ascending length.
    """
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    cost = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = lengths[order[end - 1]]
        for start in range(end):
            c = cost[start] + overhead + (end - start) * longest
            if c < cost[end]:
                cost[end], cut[end] = c, start
    groups: list[list[int]] = []
    end = n
    while end > 0:
        groups.append(sorted(order[cut[end]:end]))
        end = cut[end]
    return groups[::-1]


def _top(tops: list[Any] | None, row: Row, *at: int) -> Any:
    """Row ``row``'s own share of `_tops` at ``at`` (None when it records none)."""
    if tops is None or row.state.top_k == 0:
        return None
    here = tops
    for i in at:
        here = here[i]
    return here[:row.state.top_k]


class DecodeBatch:
    """Rows decoded together. ``model`` steps them (a `LockstepPair` for contrastive decoding
    and guidance); ``prefill`` runs admitted prompts into a cache joinable with the batch's;
    ``speculative`` (a `metaloom.speculative.Speculative`) drafts and verifies; a
    ``prefix_cache`` receives every finished row's tokens (their KV stays in the pool for a
    later continuation). ``prefill_overhead`` gives the fixed cost of one more prefill forward
    in prompt tokens (`prefill_groups`; `metaloom.decode.overhead`), asked only when prompts of
    different lengths arrive together."""

    def __init__(self, model: LanguageModel, tokenizer: Tokenizer, prefill: Prefill, *,
                 prefill_overhead: Callable[[], int], speculative: Speculative | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.prefill_overhead = prefill_overhead
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.speculative = speculative
        self.prefix_cache = prefix_cache
        self.rows: list[Row] = []
        self.cache: KVCache | None = None
        self.sampler: Sampler | None = None
        self.state: SamplingState | None = None
        self.pending: torch.Tensor | None = None  # [B] each row's last emitted token, not yet fed
        self.drafter: DraftState | None = None
        self.cursors: list[Constraint | None] = []
        self.memory = BatchMemory()  # per ledger, the KV its rows hold (kv_bytes_peak)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- joining ----------------------------------------------------------------------------
    def admit(self, new: Sequence[NewRow]) -> list[Row]:
        """Prefill ``new`` rows, draw their first tokens and add them to the batch. Returns
        their `Row`s in order (some may already be finished: an end token first, a budget)."""
        if not new:
            return []
        groups: dict[Hashable, int] = {}
        reps: list[NewRow] = []
        owner: list[int] = []
        for r in new:
            key = r.group if r.group is not None else ("row", id(r))
            if key not in groups:
                groups[key] = len(reps)
                reps.append(r)
            owner.append(groups[key])
        rows = [Row(spec, row_state(self.tokenizer, spec)) for spec in new]
        for row in rows:
            row.made = len(row.state.tokens)
        go = []
        for g, rep in enumerate(reps):  # input tokens are charged before any compute
            try:
                if rep.resume is None:
                    rep.ledger.charge(input_tokens=len(rep.prompt))
                elif rep.ledger.over_budget():  # a resumed row: its recompute is charged (forwards,
                    continue  # FLOPs), its input was charged when it first joined
                go.append(g)
            except BudgetExceeded:
                pass
        admitted = [i for i in range(len(new)) if owner[i] in go]
        for i in range(len(new)):
            if owner[i] not in go:
                rows[i].state.finish("budget")
        if admitted:
            lengths = [len(reps[g].prompt) for g in go]
            overhead = self.prefill_overhead() if len(set(lengths)) > 1 else 0
            for part in prefill_groups(lengths, overhead):
                group = [go[j] for j in part]
                members = [i for i in admitted if owner[i] in group]
                self._prefill_and_join([rows[i] for i in members], [reps[g] for g in group],
                                       [group.index(owner[i]) for i in members])
        self._settle()
        return rows

    def _prefill_and_join(self, rows: list[Row], reps: list[NewRow], index: list[int]) -> None:
        capacity = max(r.capacity for r in reps) + self._room()
        cache, raw, scores = self.prefill(reps, capacity, [r.ledger for r in reps])
        if index != list(range(len(reps))):
            forked = cache.fork(index)
            release_cache(cache)
            cache = forked
            at = torch.as_tensor(index, dtype=torch.long, device=raw.device)
            raw, scores = raw[at], scores[at]
        specs = [r.spec for r in rows]
        sampler = make_sampler([s.params for s in specs], self.model.vocab_size, raw.device, encode=self._encode)
        state = sampler.start([s.prompt[:len(s.prompt) - s.prefix] for s in specs],
                              [s.prompt[len(s.prompt) - s.prefix:] for s in specs])
        cursors = [s.cursor for s in specs]
        rngs = [s.rng for s in specs]
        before = [len(row.state.tokens) for row in rows]  # a resumed row's tokens are in its prompt already
        got = draw(sampler, state, raw, scores, cursors if any(c is not None for c in cursors) else None, rngs,
                   _keys(rows))
        state = sampler.advance(state, got.tokens, got.logprobs)
        self._emit_drawn(rows, got, cursors, raw=raw)
        drafter = None
        if self.speculative is not None:
            contexts = [list(s.prompt) for s in specs]
            drafter = self.speculative.drafter.start(self.model, sampler, contexts, [s.key for s in specs])
            for row, ctx, made in zip(rows, contexts, before, strict=True):
                row.context = ctx + row.state.tokens[made:]
        self._join(rows, cache, sampler, state, got.tokens, drafter, cursors)

    def _room(self) -> int:
        """Spare cache positions a row may need past max_tokens (a speculative step's draft)."""
        return 0 if self.speculative is None else self.speculative.num_draft + 1

    def _join(self, rows: list[Row], cache: KVCache, sampler: Sampler, state: SamplingState, pending: torch.Tensor,
              drafter: DraftState | None, cursors: list[Constraint | None]) -> None:
        self.memory.join(cache, [row.spec.ledger for row in rows])
        if self.cache is None:
            self.cache, self.sampler, self.state, self.pending, self.drafter = cache, sampler, state, pending, drafter
            self.rows, self.cursors = list(rows), list(cursors)
            self.memory.charge_highs(self._measure())
            return
        assert self.sampler is not None and self.state is not None and self.pending is not None
        joined = getattr(self.cache, "join", None)
        if joined is None:
            raise UnsupportedModel(f"{type(self.cache).__name__} cannot take rows into a running batch (no join)")
        self.cache = joined(cache)
        self.state = self.state.join(state, len(self.rows), len(rows))
        self.sampler = self.sampler.join(sampler)
        self.pending = torch.cat([self.pending, pending.to(self.pending.device)])
        if self.drafter is not None and drafter is not None:
            self.drafter = self.drafter.join(drafter)
        self.rows += rows
        self.cursors += cursors
        self.memory.charge_highs(self._measure())

    def _measure(self) -> list[tuple[Ledger, int]]:
        """The ledgers whose rows hold more KV now than before, with what they hold (charged
        with the step's output tokens: one charge per ledger per step)."""
        return self.memory.measure(self.cache, getattr(self.drafter, "cache", None))  # a draft model's own cache

    # --- stepping ---------------------------------------------------------------------------
    def step(self) -> list[Row]:
        """One forward for every live row; returns the rows that received tokens or finished."""
        if not self.rows:
            return []
        assert self.cache is not None and self.sampler is not None and self.state is not None
        assert self.pending is not None
        done = [row.state.done for row in self.rows]
        ledgers = [row.spec.ledger for row in self.rows]
        rngs = [row.spec.rng for row in self.rows]
        cursors = self.cursors if any(c is not None for c in self.cursors) else None
        if self.speculative is None:
            # on the host: the model reads it there (a device copy would cost two waits a step on a GPU)
            valid = torch.tensor([0 if d else 1 for d in done], dtype=torch.long)
            raw, scores, _ = charged_forward_both(self.model, self.pending[:, None], self.cache, ledgers, valid=valid)
            highs = self._measure()
            got = draw(self.sampler, self.state, raw[:, -1], scores[:, -1], cursors, rngs, _keys(self.rows), skip=done)
            self.state = self.sampler.advance(self.state, got.tokens, got.logprobs)
            self.pending = got.tokens
            stepped = [row for row, d in zip(self.rows, done, strict=True) if not d]
            self._emit_drawn(self.rows, got, self.cursors, skip=done, raw=raw[:, -1], highs=highs)
        else:
            stepped = self._speculative_step(done, ledgers, rngs, cursors)
        self._settle()
        return stepped

    def _speculative_step(self, done: list[bool], ledgers: list[Ledger], rngs: list[torch.Generator | None],
                          cursors: list[Constraint | None] | None) -> list[Row]:
        """Draft, verify in one forward, accept, roll back (`metaloom.speculative`)."""
        assert self.cache is not None and self.sampler is not None and self.state is not None
        assert self.pending is not None and self.drafter is not None and self.speculative is not None
        device = self.pending.device
        room = self.cache.capacity - int(self.cache.lengths.max()) - 1  # never draft past the cache
        limits = [0 if d else max(0, min(self.speculative.num_draft, room, row.state.max_tokens - len(row.state.tokens) - 1))
                  for row, d in zip(self.rows, done, strict=True)]
        draft = _checked(self.drafter.propose([row.context for row in self.rows], limits, ledgers), limits, device)
        tokens = torch.cat([self.pending[:, None], draft.tokens], dim=1)  # [B, K+1]
        start = self.cache.lengths.clone()
        finished = torch.tensor(done, dtype=torch.bool, device=start.device)
        valid = torch.where(finished.to(device), torch.zeros_like(draft.lengths), 1 + draft.lengths)
        if draft.parents is not None:
            return self._tree_step(draft, tokens, start, valid, done, ledgers, rngs, cursors)
        needs_hidden = bool(getattr(self.drafter, "needs_hidden", False))
        raw, scores, hidden = charged_forward_both(self.model, tokens, self.cache, ledgers, valid=valid,
                                                   hidden=needs_hidden)
        highs = self._measure()  # the drafts' KV is held until the rejected ones are rolled back below
        live_cursors = None if cursors is None else [None if d else c for c, d in zip(cursors, done, strict=True)]
        out = verify(self.sampler, self.state, scores, draft, live_cursors, rngs, _keys(self.rows))
        acc = out.acceptance
        self.state = out.state
        chosen = out.logprobs.gather(-1, acc.tokens.to(out.logprobs.device)[..., None])[..., 0]  # [B, K+1]
        # where the pipeline is plain log-softmax of the model's own logits, the two agree
        same = raw is scores and self.sampler.plain and cursors is None and not out.errors
        emitted_lp = (chosen if same else raw_logprobs(raw, acc.tokens.to(raw.device))).tolist()
        chosen_lp = chosen.tolist()
        emitted = [acc.emitted(b) for b in range(len(self.rows))]
        positions = [list(range(len(e))) for e in emitted]
        stepped = self._emit_verified(done, out.errors, emitted, positions, emitted_lp, chosen_lp,
                                      _tops(self.rows, done, raw), draft, acc.accepted.tolist(), highs)
        # keep pending + accepted drafts; rows finished before this step keep nothing
        self.cache.truncate(torch.where(finished, start, start + 1 + acc.accepted.to(start.device)))
        rows_index = torch.arange(len(self.rows), device=device)
        self.pending = acc.tokens[rows_index, acc.accepted.to(device)]
        self.drafter.observe(Observed(draft=draft, logits=raw, accepted=acc.accepted, tokens=acc.tokens, hidden=hidden,
                                      pending=tokens[:, 0]))
        return stepped

    def _tree_step(self, draft: Draft, tokens: torch.Tensor, start: torch.Tensor, valid: torch.Tensor,
                   done: list[bool], ledgers: list[Ledger], rngs: list[torch.Generator | None],
                   cursors: list[Constraint | None] | None) -> list[Row]:
        """`_speculative_step` for token-tree drafts: one tree-masked verify forward, a path
        accepted per row (`metaloom.decode.tree_verify`), the path's KV kept where it was written
        and the rejected branches' slots let go (`PagedKVCache.keep_entries`)."""
        assert self.cache is not None and self.sampler is not None and self.state is not None
        assert self.drafter is not None and draft.parents is not None
        if not isinstance(self.cache, PagedKVCache):
            raise UnsupportedModel(f"token trees need the native engine's paged KV cache, not {type(self.cache).__name__}")
        masks = draft.tree_attention(tokens.shape[1])
        needs_hidden = bool(getattr(self.drafter, "needs_hidden", False))
        raw, scores, hidden = charged_forward_both(self.model, tokens, self.cache, ledgers, valid=valid, tree=masks,
                                                   hidden=needs_hidden)
        highs = self._measure()
        live_cursors = None if cursors is None else [None if d else c for c, d in zip(cursors, done, strict=True)]
        out = verify_tree(self.sampler, self.state, scores, draft, live_cursors, rngs, _keys(self.rows))
        self.state = out.state
        width = tokens.shape[1]
        at = torch.tensor([p + [0] * (width - len(p)) for p in out.positions], device=raw.device)  # [B, T]
        emitted = torch.tensor([t + [0] * (width - len(t)) for t in out.tokens], device=raw.device)
        rows_index = torch.arange(len(self.rows), device=raw.device)[:, None]
        chosen_lp = out.logprobs.to(raw.device)[rows_index, at].gather(-1, emitted[..., None])[..., 0].tolist()
        emitted_lp = raw_logprobs(raw[rows_index, at], emitted).tolist()
        stepped = self._emit_verified(done, out.errors, out.tokens, out.positions, emitted_lp, chosen_lp,
                                      _tops(self.rows, done, raw), draft, out.accepted, highs)
        for b in range(len(self.rows)):  # keep the pending token and the accepted path; rows done before keep nothing
            s = int(start[b])
            keep = range(s) if done[b] else [*range(s), *(s + p for p in out.positions[b])]
            self.cache.keep_entries(b, np.asarray(list(keep), dtype=np.int64))
        self.pending = torch.tensor([t[-1] for t in out.tokens], device=self.pending.device if self.pending is not None
                                    else raw.device)
        accepted = torch.tensor(out.accepted)
        flat = torch.tensor([t + [0] * (width - len(t)) for t in out.tokens])
        self.drafter.observe(Observed(draft=draft, logits=raw, accepted=accepted, tokens=flat, hidden=hidden,
                                      pending=tokens[:, 0]))
        return stepped

    def _emit_verified(self, done: Sequence[bool], errors: dict[int, str], tokens: Sequence[Sequence[int]],
                       positions: Sequence[Sequence[int]], emitted_lp: list[list[float]], chosen_lp: list[list[float]],
                       tops: list[Any] | None, draft: Draft, accepted: Sequence[int],
                       highs: Sequence[tuple[Ledger, int]]) -> list[Row]:
        """Emit a verify step's tokens row by row (``tokens[b]``, each drawn at block position
        ``positions[b][j]``; its log-probabilities ``emitted_lp[b][j]`` and ``chosen_lp[b][j]``)
        and charge the step; -> the rows that took part."""
        stepped, per_ledger = [], _Tally()
        per_ledger.peaks(highs)
        for b, row in enumerate(self.rows):
            if done[b]:
                continue
            stepped.append(row)
            if b in errors:
                row.state.finish("error", error=errors[b])
                continue
            count = 0
            for j, token in enumerate(tokens[b]):
                emit(row.state, token, emitted_lp[b][j], chosen_lp[b][j], self.cursors[b],
                     _top(tops, row, b, positions[b][j]))
                row.context.append(token)
                count += 1
                if row.state.done:
                    break
            drafted, kept = int(draft.lengths[b]), int(accepted[b])
            per_ledger.add(row.spec.ledger, output_tokens=count, drafted_tokens=drafted, accepted_tokens=kept,
                           rejected_tokens=drafted - kept, verify_steps=1)
        per_ledger.charge()
        return stepped

    def _emit_drawn(self, rows: Sequence[Row], got: Any, cursors: Sequence[Constraint | None],
                    skip: Sequence[bool] = (), *, raw: torch.Tensor, highs: Sequence[tuple[Ledger, int]] = ()) -> None:
        """Emit each row's drawn token; ``raw`` [B, V]: the logits it was drawn after (for the
        rows that record their most likely tokens); ``highs``: KV peaks to charge with the tokens."""
        tally = _Tally()
        tally.peaks(highs)
        # one device-to-host copy for the four (token ids are exact in float64); the step's only wait
        tokens_f, raw_lp, chosen, dead = torch.stack([got.tokens.double(), got.raw.double(), got.chosen.double(),
                                                      got.dead.double()]).tolist()
        tokens = [int(t) for t in tokens_f]
        errors = got.failures(dead, skip)
        tops = _tops(rows, skip, raw)
        for b, row in enumerate(rows):
            if skip and skip[b]:
                continue
            if b in errors:
                row.state.finish("error", error=errors[b])
                continue
            emit(row.state, tokens[b], raw_lp[b], chosen[b], cursors[b], _top(tops, row, b))
            if row.context:
                row.context.append(tokens[b])
            tally.add(row.spec.ledger, output_tokens=1)
        tally.charge()

    # --- leaving ----------------------------------------------------------------------------
    def _settle(self) -> None:
        """End the rows whose ledger went over budget; let finished rows leave."""
        over: dict[int, bool] = {}
        for row in self.rows:
            if not row.state.done:
                key = id(row.spec.ledger)
                if key not in over:
                    over[key] = row.spec.ledger.over_budget()
                if over[key]:
                    row.state.finish("budget")
        finished = [i for i, row in enumerate(self.rows) if row.state.done]
        if not finished:
            return
        # a paged cache drops rows for free; another cache copies its rows, so wait for half
        if not isinstance(self.cache, PagedKVCache) and 2 * len(finished) < len(self.rows):
            return
        if self.prefix_cache is not None and isinstance(self.cache, PagedKVCache):
            lengths = self.cache.lengths.tolist()
            for i in finished:  # keep what was generated: a continuation of it prefills nothing
                row = self.rows[i]
                ids = list(row.spec.prompt) + row.state.tokens[row.made:]
                self.prefix_cache.insert(ids[:lengths[i]], self.cache, i)
        self.keep([i for i in range(len(self.rows)) if not self.rows[i].state.done])

    def keep(self, positions: list[int]) -> None:
        """Keep only the rows at ``positions`` (batch order); the others leave and free their cache."""
        if not positions:
            release_cache(self.cache)
            self.memory.select([])
            self.rows, self.cursors = [], []
            self.cache = self.sampler = self.state = self.pending = self.drafter = None
            return
        assert self.cache is not None and self.sampler is not None and self.state is not None
        assert self.pending is not None
        if positions == list(range(len(self.rows))):
            return
        old = self.cache
        self.cache = old.fork(positions)
        release_cache(old)
        self.memory.select(positions)
        self.sampler = self.sampler.select(positions)
        self.state = self.state.select(positions)
        self.pending = self.pending[torch.as_tensor(positions, dtype=torch.long, device=self.pending.device)]
        if self.drafter is not None:
            self.drafter = self.drafter.select(positions)
        self.rows = [self.rows[i] for i in positions]
        self.cursors = [self.cursors[i] for i in positions]

    def detach(self, rows: Sequence[Row]) -> list[NewRow]:
        """Take live ``rows`` out of the batch without ending them, freeing their cache; returns
        what to `admit` later for each to carry on exactly where it was (its prompt extended by
        what it generated, recomputed then: vLLM's recompute preemption, Kwon et al. 2023)."""
        leaving = {id(r) for r in rows}
        out = []
        for i, row in enumerate(self.rows):
            if id(row) not in leaving:
                continue
            if row.state.done:
                raise InvalidParameter("rows", "a finished row", "live rows (a finished row leaves by itself)")
            made = tuple(row.state.tokens[row.made:])
            spec = row.spec
            out.append(dataclasses.replace(spec, prompt=spec.prompt + made, prefix=spec.prefix + len(made), group=None,
                                           secondary=None if spec.secondary is None else spec.secondary + made,
                                           cursor=self.cursors[i], resume=row.state))
        self.keep([i for i, row in enumerate(self.rows) if id(row) not in leaving])
        return out

    def cancel(self, rows: Sequence[Row], reason: str = "cancelled") -> None:
        """End ``rows`` now and free them: "cancelled" (a closed stream, a disconnected client),
        or another finish reason their caller decided on (a server ending a reply that repeats)."""
        for row in rows:
            row.state.finish(reason)
        self._settle()

    def close(self) -> None:
        """Cancel every live row and free the batch's cache."""
        self.cancel(list(self.rows))
        self.keep([])


class _Tally:
    """Charges gathered per ledger, applied once each (per-row ledgers never raise here: the
    loop asks each ledger afterwards, see `DecodeBatch._settle`)."""

    def __init__(self) -> None:
        self.by: dict[int, tuple[Ledger, dict[str, int]]] = {}

    def add(self, ledger: Ledger, **amounts: int) -> None:
        entry = self.by.setdefault(id(ledger), (ledger, {}))[1]
        for k, v in amounts.items():
            entry[k] = entry.get(k, 0) + v

    def peaks(self, highs: Sequence[tuple[Ledger, int]]) -> None:
        """KV peaks (`metaloom.decode.memory.BatchMemory.measure`), charged with the rest: a
        ledger's usage keeps the larger peak, so one charge carries it as well as two."""
        for ledger, now in highs:
            self.by.setdefault(id(ledger), (ledger, {}))[1]["kv_bytes_peak"] = now

    def charge(self) -> None:
        for ledger, amounts in self.by.values():
            with contextlib.suppress(BudgetExceeded):
                ledger.charge(**amounts)



def _keys(rows: Sequence[Row]) -> np.ndarray:
    """[B, 2] int64: each row's random key and the tokens it has drawn so far, the counter of its
    next draw (`metaloom.sampling.counter`), on the host."""
    return np.array([(row.spec.key, len(row.state.tokens)) for row in rows], dtype=np.int64).reshape(-1, 2)


def _checked(draft: Draft, limits: Sequence[int], device: torch.device) -> Draft:
    """Hold a drafter to its limits (a longer draft would overflow the cache or max_tokens)."""
    cap = torch.as_tensor(list(limits), dtype=torch.long, device=device)
    lengths = torch.minimum(draft.lengths.to(device), cap)
    k = int(lengths.max()) if lengths.numel() else 0
    probs = None if draft.probs is None else draft.probs[:, :k].to(device)
    parents = None if draft.parents is None else draft.parents[:, :k].to(device)  # a prefix of a tree is a tree
    if parents is not None and probs is not None:
        raise InvalidParameter("draft", "a sampled tree", "deterministic token trees (probs None)")
    return Draft(tokens=draft.tokens[:, :k].to(device), lengths=lengths, probs=probs, parents=parents)
