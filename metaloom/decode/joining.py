"""What joins the decode batch (`metaloom.decode.batch`) and what a row of it carries.

`NewRow` is one output row to admit (its prompt, parameters, ledger, random key, constraint
cursor; a preempted row's state to resume); `Row` is a row in the batch, with `row_state` the
decoding state it starts with. `Prefill` is what the batch calls to run admitted prompts into a
cache, and `prefill_groups` splits prompts of mixed lengths into the cheapest prefill forwards.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from metaloom.constrain import Constraint
from metaloom.decode.rows import RowState
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, Tokenizer
from metaloom.sampling.counter import KEY_BITS
from metaloom.sampling.params import SamplingParams


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


def row_keys(rows: Sequence[Row]) -> np.ndarray:
    """[B, 2] int64: each row's random key and the tokens it has drawn so far, the counter of its
    next draw (`metaloom.sampling.counter`), on the host."""
    return np.array([(row.spec.key, len(row.state.tokens)) for row in rows], dtype=np.int64).reshape(-1, 2)
