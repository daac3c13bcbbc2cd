"""The logits pipeline: one documented order, written once, used by every decoder.

Order (each step a pure batched function in `penalties.py`, `processors.py`, `truncation.py`):

1. penalties: repetition (prompt + output), presence and frequency (output), DRY (history),
   no-repeat-n-gram (history)
2. logit bias
3. constraint mask (issue: constrained decoding; the caller's cursor passes ``mask``)
4. temperature, or dynamic temperature when ``dynatemp_range > 0`` (rows with temperature 0
   are greedy and skip steps 4-7)
5. truncation: top-nσ -> top-H -> top-k -> top-p -> min-p -> typical -> epsilon -> eta
   (top-nσ and top-H look at the whole distribution; from top-H on this is transformers'
   warper order, so a chain of its processors gives the same distribution). The steps that
   rank by probability (top-H, top-k, top-p, min-p) share one sort (`truncation.truncate`)
6. XTC (a coin per row from the row's `torch.Generator`)
7. mirostat v2 (bound ``mu`` per row, from the `SamplingState`)
8. draw: argmax for greedy rows, otherwise a categorical draw keyed by the row's seed and
   position (`metaloom.sampling.counter`: batched, reproducible whatever the batch);
   then `Sampler.advance` updates the state (seen/counts/history, and mu from the drawn
   token's surprise under the distribution of step 7)

`Sampler.process` returns the final log-probabilities the draw uses (masked entries are -inf),
so speculative decoding can verify against exactly this distribution. Every step after the
first sees the previous step's output, renormalised. Disabled adapters are skipped for the
whole batch (a Python check, no device sync); rows that disable an adapter another row uses
come back from it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from metaloom.errors import InvalidParameter
from metaloom.sampling import counter
from metaloom.sampling import processors as P
from metaloom.sampling.knobs import knobs
from metaloom.sampling.params import ADAPTER_COLUMNS, INTEGER_FIELDS, SamplingParams
from metaloom.sampling.state import SamplingState
from metaloom.sampling.truncation import STEPS, Step, truncate

NEG_INF = float("-inf")

# stage 5: each truncation step with the adapter its field's knob names
_ADAPTER = {f.name: k.adapter for f, k in knobs(SamplingParams)}
_TRUNCATION: tuple[tuple[str, Step], ...] = tuple((str(_ADAPTER[step.field]), step) for step in STEPS)


@dataclass(frozen=True)
class Sampler:
    """Per-row parameters of one batch, stacked into tensors once. Holds no mutable state:
    per-row state lives in a `SamplingState` (`start`, `advance`), randomness in the caller's
    `torch.Generator`s. Build with `make_sampler`.

    ``params[i]`` is the `SamplingParams` of row ``i``; ``columns[name]`` [B] the stacked values
    of the fields the enabled adapters read, plus ``temperature``, ``greedy`` and ``mirostat``
    (bool: row uses mirostat v2).
    """

    params: tuple[SamplingParams, ...]
    vocab_size: int
    enabled: frozenset[str]  # adapters some row uses (`SamplingParams.adapters`)
    columns: dict[str, torch.Tensor]
    bias: torch.Tensor | None  # [B, V] or None
    breakers: torch.Tensor | None  # [B, V] bool: DRY sequence breakers, or None

    @property
    def greedy(self) -> torch.Tensor:  # [B] bool
        return self.columns["greedy"]

    @property
    def temperature(self) -> torch.Tensor:  # [B]
        return self.columns["temperature"]

    @property
    def plain(self) -> bool:
        """True when `process` is plain log-softmax for every row: greedy rows (or temperature 1)
        with no adapter and no logit bias. (A constraint mask still applies: callers check it.)"""
        return not self.enabled and all(p.greedy or p.temperature == 1.0 for p in self.params)

    def start(self, prompts: Sequence[Sequence[int]] | None = None,
              outputs: Sequence[Sequence[int]] | None = None) -> SamplingState:
        """The state before the next draw; ``prompts[i]`` are row ``i``'s prompt token ids
        (repetition penalty, DRY and no-repeat-n-gram look at them) and ``outputs[i]`` the ids
        it has already generated (a continuation's prefix: they also count for presence and
        frequency penalties). None: empty. Mirostat's bound starts afresh either way."""
        rows = [list(p) for p in prompts] if prompts is not None else [[] for _ in self.params]
        done = [list(o) for o in outputs] if outputs is not None else [[] for _ in rows]
        if len(rows) != len(self.params) or len(done) != len(rows):
            raise ValueError(f"{len(rows)} prompts and {len(done)} outputs for a batch of {len(self.params)} rows")
        rows = [p + o for p, o in zip(rows, done, strict=True)]
        device, b, v = self.temperature.device, len(rows), self.vocab_size
        seen = None
        if "repetition" in self.enabled:
            seen = torch.zeros(b, v, dtype=torch.bool)
            for i, p in enumerate(rows):
                seen[i, torch.as_tensor(p, dtype=torch.long)] = True
            seen = seen.to(device)
        counts = None
        if "presence_frequency" in self.enabled:
            counts = torch.zeros(b, v, dtype=torch.int32)
            for i, o in enumerate(done):
                if o:
                    counts[i].scatter_add_(0, torch.as_tensor(o, dtype=torch.long), torch.ones(len(o), dtype=torch.int32))
            counts = counts.to(device)
        history = lengths = None
        if self.enabled & {"dry", "no_repeat_ngram"}:
            history = torch.full((b, max((len(p) for p in rows), default=0)), -1, dtype=torch.long)
            for i, p in enumerate(rows):
                history[i, :len(p)] = torch.as_tensor(p, dtype=torch.long)
            history = history.to(device)
            lengths = torch.tensor([len(p) for p in rows], dtype=torch.long, device=device)
        mu = 2 * self.columns["mirostat_tau"] if "mirostat" in self.enabled else None  # llama.cpp's start
        return SamplingState(seen=seen, counts=counts, history=history, lengths=lengths, mu=mu)

    def process(self, logits: torch.Tensor, state: SamplingState | None = None, *, mask: torch.Tensor | None = None,
                generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
        """Steps 1-7. logits [B, V] (any float dtype) -> log-probabilities [B, V] in float32.

        ``state`` from `start` / `advance` (needed by penalties, DRY, n-grams, mirostat);
        ``mask`` [B, V] bool: allowed tokens (constraint); ``generators[i]``: row ``i``'s RNG for
        the XTC coin (None: torch's default). Greedy rows come back as log-softmax of the
        penalised, biased, masked logits.
        """
        on, c = self.enabled, self.columns
        s = state if state is not None else SamplingState()
        x = logits.float()
        if "repetition" in on:
            x = P.repetition_penalty(x, s.need("seen", "repetition_penalty"), c["repetition_penalty"])
        if "presence_frequency" in on:
            x = P.presence_frequency_penalty(x, s.need("counts", "presence/frequency penalty"), c["presence_penalty"],
                                             c["frequency_penalty"])
        if "dry" in on:
            assert self.breakers is not None
            x = P.dry(x, s.need("history", "DRY"), s.need("lengths", "DRY"), self.breakers, c["dry_multiplier"],
                      c["dry_base"], c["dry_allowed_length"], c["dry_penalty_last_n"])
        if "no_repeat_ngram" in on:
            x = P.no_repeat_ngram(x, s.need("history", "no_repeat_ngram_size"), s.need("lengths", "no_repeat_ngram_size"),
                                  c["no_repeat_ngram_size"])
        if self.bias is not None:
            x = x + self.bias
        if mask is not None:
            x = x.masked_fill(~mask, NEG_INF)
        greedy = [p.greedy for p in self.params]
        if all(greedy):
            return torch.log_softmax(x, dim=-1)
        t = torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)
        dynamic = "dynatemp" in on
        y = P.dynamic_temperature(x, t, c["dynatemp_range"], c["dynatemp_exponent"]) if dynamic else P.temperature(x, t)
        y = truncate(y, [(step, c[step.field]) for adapter, step in _TRUNCATION if adapter in on])
        if "xtc" in on:
            y = P.xtc(y, c["xtc_threshold"], self._coins(generators, logits.device))
        if "mirostat" in on:
            y = P.mirostat(y, s.need("mu", "mirostat"), c["mirostat"])
        if any(greedy):
            y = torch.where(self.greedy[:, None], x, y)
        return torch.log_softmax(y, dim=-1)

    def _coins(self, generators: Sequence[torch.Generator | None] | None, device: torch.device) -> torch.Tensor:
        """XTC: one uniform draw per row that uses it, from the row's generator; heads when
        u < xtc_probability. [B] bool."""
        heads = []
        for row, p in enumerate(self.params):
            if "xtc" not in p.adapters:
                heads.append(False)
                continue
            g = generators[row] if generators is not None else None
            u = float(torch.rand((), generator=g, device=g.device if g is not None else device))
            heads.append(u < p.xtc_probability)
        return torch.tensor(heads, dtype=torch.bool, device=device)

    @property
    def all_greedy(self) -> bool:
        """Every row is greedy: a draw needs no uniforms."""
        return all(p.greedy for p in self.params)

    def draw(self, logprobs: torch.Tensor, u: torch.Tensor | None, argmax: torch.Tensor | None = None,
             search: counter.Search | None = None) -> torch.Tensor:
        """Step 8. logprobs [B, V] -> tokens [B] (long): argmax for greedy rows, otherwise the
        inverse-CDF draw at ``u`` [B] (uniforms in [0, 1): `metaloom.sampling.counter`, keyed by
        each row's seed and position; None only where every row is greedy), for the whole batch
        at once. ``argmax``: ``logprobs.argmax(-1)`` if the caller has it already; ``search``: a
        faster way to the same draw (`counter.inverse_cdf`)."""
        tokens = logprobs.argmax(dim=-1) if argmax is None else argmax
        if self.all_greedy:
            return tokens.clone()
        if u is None:
            raise ValueError("sampled rows need uniforms (u)")
        drawn = counter.inverse_cdf(logprobs, u, search)
        return torch.where(self.greedy.to(drawn.device), tokens, drawn)

    def advance(self, state: SamplingState, tokens: torch.Tensor, logprobs: torch.Tensor) -> SamplingState:
        """The state after each row drew ``tokens`` [B] from ``logprobs`` [B, V] (what `process`
        returned). Returns a new state; ``state`` is not modified (an `empty` one comes back as it is)."""
        if state.empty:  # frozen, so sharing it is safe; this spares a decode step a tensor op after its forward
            return state
        column = tokens.to(torch.long)[:, None]
        seen = counts = history = lengths = mu = None
        if state.seen is not None:
            seen = state.seen.scatter(1, column, True)
        if state.counts is not None:
            counts = state.counts.scatter_add(1, column, torch.ones_like(column, dtype=state.counts.dtype))
        if state.history is not None and state.lengths is not None:
            pad = torch.full_like(state.history[:, :1], -1)
            history = torch.cat([state.history, pad], dim=1).scatter(1, state.lengths[:, None], column)
            lengths = state.lengths + 1
        if state.mu is not None:
            c = self.columns
            moved = P.mirostat_update(state.mu, logprobs.gather(1, column)[:, 0], c["mirostat_tau"], c["mirostat_eta"])
            mu = torch.where(c["mirostat"], moved, state.mu)
        return SamplingState(seen=seen, counts=counts, history=history, lengths=lengths, mu=mu)

    def select(self, rows: Sequence[int]) -> Sampler:
        """The sampler of a sub-batch (rows in the order given)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.temperature.device)
        params = tuple(self.params[r] for r in rows)
        return Sampler(
            params=params, vocab_size=self.vocab_size,
            enabled=frozenset().union(*(p.adapters for p in params)),
            columns={name: col[index] for name, col in self.columns.items()},
            bias=None if self.bias is None else self.bias[index],
            breakers=None if self.breakers is None else self.breakers[index])



    def join(self, other: Sampler) -> Sampler:
        """This batch's rows, then ``other``'s (rows joining a running decode loop)."""
        if other.vocab_size != self.vocab_size:
            raise InvalidParameter("vocab_size", other.vocab_size, f"{self.vocab_size} (the batch's)")
        params = self.params + other.params
        device = self.temperature.device

        def column(side: Sampler, name: str) -> torch.Tensor:
            # a side whose rows do not use the adapter has no column: its rows' own (disabled) values
            if name in side.columns:
                return side.columns[name].to(device)
            like = self.columns[name] if name in self.columns else other.columns[name]
            return torch.tensor([getattr(p, name) for p in side.params], dtype=like.dtype, device=device)

        names = set(self.columns) | set(other.columns)
        columns = {name: torch.cat([column(self, name), column(other, name)]) for name in names}

        def stacked(a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
            if a is None and b is None:
                return None
            parts = [t.to(device) if t is not None else torch.zeros(len(side.params), self.vocab_size, dtype=dtype,
                                                                     device=device)
                     for t, side in ((a, self), (b, other))]
            return torch.cat(parts)

        return Sampler(params=params, vocab_size=self.vocab_size, enabled=self.enabled | other.enabled, columns=columns,
                       bias=stacked(self.bias, other.bias, torch.float32),
                       breakers=stacked(self.breakers, other.breakers, torch.bool))

def make_sampler(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu", *,
                 encode: Callable[[str], Sequence[int]] | None = None) -> Sampler:
    """Stack the per-row parameters of a batch (one entry per row, not per request).

    ``encode`` (text -> token ids, the tokenizer's) maps DRY sequence breakers to tokens: the
    last token of each breaker's encoding is a breaker, as in text-generation-webui. It is
    needed only when some row uses DRY with breakers.
    """
    rows = tuple(params)
    for p in rows:
        p.check_vocab(vocab_size)
    enabled = frozenset().union(*(p.adapters for p in rows))

    def col(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in rows], dtype=dtype, device=device)

    columns = {"temperature": col("temperature"),
               "greedy": torch.tensor([p.greedy for p in rows], dtype=torch.bool, device=device),
               "mirostat": torch.tensor(["mirostat" in p.adapters for p in rows], dtype=torch.bool, device=device)}
    for adapter in enabled:
        for name in ADAPTER_COLUMNS.get(adapter, ()):
            columns[name] = col(name, torch.long if name in INTEGER_FIELDS else torch.float32)
    bias = None
    if "logit_bias" in enabled:
        bias = torch.zeros(len(rows), vocab_size)
        for i, p in enumerate(rows):
            for token, value in p.logit_bias.items():
                bias[i, token] = value
        bias = bias.to(device)
    breakers = None
    if "dry" in enabled:
        breakers = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
        for i, p in enumerate(rows):
            if "dry" not in p.adapters or not p.dry_sequence_breakers:
                continue
            if encode is None:
                raise InvalidParameter("dry_sequence_breakers", p.dry_sequence_breakers,
                                       "strings only with a tokenizer: pass encode= to make_sampler (or use no breakers)")
            for text in p.dry_sequence_breakers:
                ids = [t for t in encode(text) if 0 <= t < vocab_size]
                if ids:
                    breakers[i, ids[-1]] = True
        breakers = breakers.to(device)
    return Sampler(params=rows, vocab_size=vocab_size, enabled=enabled, columns=columns, bias=bias, breakers=breakers)
