"""`SamplingState`: the per-row state some pipeline steps need, kept outside the `Sampler`.

Created by `Sampler.start(prompts)`, read by `Sampler.process`, and replaced after every draw
by `Sampler.advance(state, tokens, logprobs)` (a new object; the old one is not modified, so
speculative decoding can keep a state to roll back to). Only the fields some row of the batch
needs are filled; the rest stay None, so disabled adapters cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SamplingState:
    seen: torch.Tensor | None = None  # [B, V] bool: token in prompt or output (repetition penalty)
    counts: torch.Tensor | None = None  # [B, V] int32: output-token counts (presence / frequency)
    history: torch.Tensor | None = None  # [B, L] long: prompt then output, right-padded with -1 (DRY, n-grams)
    lengths: torch.Tensor | None = None  # [B] long: valid length of each history row
    mu: torch.Tensor | None = None  # [B] float32: mirostat v2 surprise bound, bits

    @property
    def empty(self) -> bool:
        """Keeps nothing (no adapter that looks back is on): advancing it changes nothing."""
        return self.seen is None and self.counts is None and self.history is None and self.lengths is None \
            and self.mu is None

    def select(self, rows: Sequence[int]) -> SamplingState:
        """The state of a sub-batch (rows in the order given)."""
        changes = {}
        for name in ("seen", "counts", "history", "lengths", "mu"):
            value = getattr(self, name)
            if value is not None:
                changes[name] = value[torch.as_tensor(list(rows), dtype=torch.long, device=value.device)]
        return replace(self, **changes)

    def join(self, other: SamplingState, rows: int, other_rows: int) -> SamplingState:
        """This state's ``rows`` rows, then ``other``'s ``other_rows`` (rows joining a decode loop).
        A field only one side tracks is filled for the other side's rows with values their
        (disabled) adapters never read."""
        out: dict[str, torch.Tensor | None] = {}
        for name in ("seen", "counts", "history", "lengths", "mu"):
            a, b = getattr(self, name), getattr(other, name)
            if a is None and b is None:
                out[name] = None
                continue
            like = a if a is not None else b
            assert like is not None
            if name == "history":
                width = max(t.shape[1] for t in (a, b) if t is not None)
                parts = []
                for t, n in ((a, rows), (b, other_rows)):
                    if t is None:
                        t = torch.full((n, width), -1, dtype=like.dtype, device=like.device)
                    elif t.shape[1] < width:
                        t = torch.cat([t, torch.full((n, width - t.shape[1]), -1, dtype=t.dtype, device=t.device)], dim=1)
                    parts.append(t)
                out[name] = torch.cat(parts)
                continue
            parts = [t if t is not None else torch.zeros((n, *like.shape[1:]), dtype=like.dtype, device=like.device)
                     for t, n in ((a, rows), (b, other_rows))]
            out[name] = torch.cat(parts)
        return SamplingState(**out)

    def need(self, name: str, adapter: str) -> torch.Tensor:
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"{adapter} needs SamplingState.{name}: build the state with Sampler.start(prompts)")
        return value
