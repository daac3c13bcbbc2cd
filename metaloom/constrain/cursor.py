"""The per-row cursor protocol and the batch mask (see `metaloom.constrain` for the API)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from metaloom.constrain.grammar import GrammarCursor, grammar_masks


@runtime_checkable
class Constraint(Protocol):
    """One row's cursor. ``unconstrained`` is True while `mask` would allow every token."""

    @property
    def unconstrained(self) -> bool: ...

    def mask(self) -> torch.Tensor: ...  # [V] bool

    def advance(self, token: int) -> None: ...

    def rollback(self, n: int) -> None: ...

    def fork(self) -> Constraint: ...

    def done(self) -> bool: ...


def batch_mask(cursors: Sequence[Constraint | None], vocab_size: int,
               device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The allowed-token mask of a batch, [B, V] bool on ``device``, or None when no row is
    constrained. Grammar cursors of one vocabulary are computed in one parallel engine call."""
    active = [(i, c) for i, c in enumerate(cursors) if c is not None and not c.unconstrained]
    if not active:
        return None
    out = np.ones((len(cursors), vocab_size), dtype=np.bool_)
    by_vocab: dict[int, list[tuple[int, GrammarCursor]]] = {}
    for i, c in active:
        if isinstance(c, GrammarCursor):
            by_vocab.setdefault(id(c.vocab), []).append((i, c))
        else:
            out[i] = c.mask().numpy()
    for group in by_vocab.values():
        out[[i for i, _ in group]] = grammar_masks([c for _, c in group])
    return torch.from_numpy(out).to(device)
