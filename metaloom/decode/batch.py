"""The one decode loop: rows join and leave a running batch between steps.

`DecodeBatch` holds the rows being decoded together, their KV cache, their sampling
parameters and state, their constraint cursors and RNGs. `admit` adds rows at any time
between steps: their prompts are prefilled (each distinct prompt once, then forked to its
samples; through the radix prefix cache when there is one), their first token is drawn, and
their cache rows, sampler rows, pipeline state and drafter state are appended to the batch's.
`step` advances every live row by one forward. Finished rows leave (their cache freed, their
generated tokens stored in the prefix cache) before the next step. `generate`, `stream`, the
server's continuous batching and tree search's expansions all drive this one loop. What joins
(`NewRow`) and what a row carries (`Row`) are `metaloom.decode.joining`.

A step, for every decoder:

1. (speculative decoding) each row's drafter proposes tokens after its pending token;
2. one forward over ``[pending, draft]`` per row (``valid`` right-pads rows of different
   draft lengths; a finished row still in the batch feeds nothing);
3. plain: `select.draw` one token per row; speculative (`metaloom.decode.speculative_step`):
   `select.verify` a prefix of each draft plus one token (a plain step is a speculative step
   with empty drafts, and takes the plain draw for speed);
4. `rows.emit` every new token (stop strings, end-of-sequence, constraint completion and
   ``max_tokens`` end a row exactly where they occur), roll the cache back past rejected
   drafts, charge each row's ledger (`metaloom.decode.emitting`).

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

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from metaloom.constrain import Constraint
from metaloom.decode.emitting import emit_drawn
from metaloom.decode.joining import NewRow, Prefill, Row, prefill_groups, row_keys, row_state
from metaloom.decode.memory import BatchMemory
from metaloom.decode.prefill import release_cache
from metaloom.decode.select import draw
from metaloom.decode.speculative_step import speculative_step
from metaloom.errors import BudgetExceeded, InvalidParameter, UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.forward import charged_forward_both
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.prefix.pool import PrefixCache
from metaloom.sampling.pipeline import Sampler, make_sampler
from metaloom.sampling.state import SamplingState
from metaloom.speculative import Speculative
from metaloom.speculative.drafter import DraftState


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
                   row_keys(rows))
        state = sampler.advance(state, got.tokens, got.logprobs)
        emit_drawn(rows, got, cursors, raw=raw)
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
            self.memory.charge_highs(self.measure())
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
        self.memory.charge_highs(self.measure())

    def measure(self) -> list[tuple[Ledger, int]]:
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
            stepped = self.plain_step(done, ledgers, rngs, cursors)[0]
        else:
            stepped = speculative_step(self, done, ledgers, rngs, cursors)
        self._settle()
        return stepped

    def plain_step(self, done: list[bool], ledgers: list[Ledger], rngs: list[torch.Generator | None],
                   cursors: list[Constraint | None] | None, hidden: bool = False,
                   also: Mapping[str, int] | None = None) -> tuple[list[Row], torch.Tensor, torch.Tensor | None]:
        """One token a row: forward, `draw`, emit. -> (the rows stepped, the raw logits [B, 1, V],
        the final hidden states [B, 1, d] when ``hidden``: what a drafter observes after a step
        it drafted nothing for). ``also``: more counts charged with each emitted token."""
        assert self.cache is not None and self.sampler is not None and self.state is not None
        assert self.pending is not None
        # on the host: the model reads it there (a device copy would cost two waits a step on a GPU)
        valid = torch.tensor([0 if d else 1 for d in done], dtype=torch.long)
        raw, scores, states = charged_forward_both(self.model, self.pending[:, None], self.cache, ledgers, valid=valid,
                                                   hidden=hidden)
        highs = self.measure()
        # one slice when the scores are the logits: `draw` then takes the pipeline's
        # log-probabilities as the reported ones (one log-softmax a step, not two)
        last = raw[:, -1]
        got = draw(self.sampler, self.state, last, last if scores is raw else scores[:, -1], cursors, rngs,
                   row_keys(self.rows), skip=done)
        self.state = self.sampler.advance(self.state, got.tokens, got.logprobs)
        self.pending = got.tokens
        stepped = [row for row, d in zip(self.rows, done, strict=True) if not d]
        emit_drawn(self.rows, got, self.cursors, skip=done, raw=last, highs=highs, also=also)
        return stepped, raw, states

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
