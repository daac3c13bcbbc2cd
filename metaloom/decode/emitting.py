"""A decode step's tokens into its rows (`metaloom.decode.batch`): each emitted with
`rows.emit` (stop strings, end-of-sequence, constraint completion and ``max_tokens`` end a row
exactly where they occur), the most likely alternatives a row records beside it, and the step's
charges gathered per ledger and applied once each (`Tally`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from metaloom.constrain import Constraint
from metaloom.decode.joining import Row
from metaloom.decode.rows import emit
from metaloom.decode.select import most_likely
from metaloom.errors import BudgetExceeded
from metaloom.ledger import Ledger
from metaloom.speculative.drafter import Draft


def row_tops(rows: Sequence[Row], skip: Sequence[bool], raw: torch.Tensor) -> list[Any] | None:
    """Every row's most likely tokens after ``raw`` [B, ..., V] (as many as the most any live
    row asks for; each row keeps its own count), or None when no live row records them."""
    k = max((row.state.top_k for b, row in enumerate(rows) if not (skip and skip[b])), default=0)
    return most_likely(raw, min(k, raw.shape[-1])) if k > 0 else None


def row_top(tops: list[Any] | None, row: Row, *at: int) -> Any:
    """Row ``row``'s own share of `row_tops` at ``at`` (None when it records none)."""
    if tops is None or row.state.top_k == 0:
        return None
    here = tops
    for i in at:
        here = here[i]
    return here[:row.state.top_k]


def emit_drawn(rows: Sequence[Row], got: Any, cursors: Sequence[Constraint | None],
               skip: Sequence[bool] = (), *, raw: torch.Tensor, highs: Sequence[tuple[Ledger, int]] = (),
               also: Mapping[str, int] | None = None) -> None:
    """Emit each row's drawn token; ``raw`` [B, V]: the logits it was drawn after (for the
    rows that record their most likely tokens); ``highs``: KV peaks to charge with the tokens;
    ``also``: more counts each emitting row's ledger is charged in the same charge (a
    speculative step that drafted nothing: one verify step)."""
    tally = Tally()
    tally.peaks(highs)
    if got.tokens.device.type == "cpu":  # no copies to save: each list read alone, the same tensor once
        tokens, raw_lp = got.tokens.tolist(), got.raw.tolist()
        chosen = raw_lp if got.chosen is got.raw else got.chosen.tolist()
        best = chosen if got.best is got.chosen else got.best.tolist()
    else:  # one device-to-host copy for the four (token ids are exact in float64); the step's only wait
        tokens_f, raw_lp, chosen, best = torch.stack([got.tokens.double(), got.raw.double(), got.chosen.double(),
                                                      got.best.double()]).tolist()
        tokens = [int(t) for t in tokens_f]
    errors = got.failures(best, skip)
    tops = row_tops(rows, skip, raw)
    for b, row in enumerate(rows):
        if skip and skip[b]:
            continue
        if b in errors:
            row.state.finish("error", error=errors[b])
            continue
        emit(row.state, tokens[b], raw_lp[b], chosen[b], cursors[b], row_top(tops, row, b))
        if row.context:
            row.context.append(tokens[b])
        tally.add(row.spec.ledger, output_tokens=1, **(also or {}))
    tally.charge()


def emit_verified(rows: Sequence[Row], cursors: Sequence[Constraint | None], done: Sequence[bool],
                  errors: dict[int, str], tokens: Sequence[Sequence[int]], positions: Sequence[Sequence[int]],
                  emitted_lp: list[list[float]], chosen_lp: list[list[float]], tops: list[Any] | None, draft: Draft,
                  accepted: Sequence[int], highs: Sequence[tuple[Ledger, int]]) -> list[Row]:
    """Emit a verify step's tokens into ``rows`` (``tokens[b]``, each drawn at block position
    ``positions[b][j]``; its log-probabilities ``emitted_lp[b][j]`` and ``chosen_lp[b][j]``)
    and charge the step; -> the rows that took part."""
    stepped: list[Row] = []
    per_ledger = Tally()
    per_ledger.peaks(highs)
    for b, row in enumerate(rows):
        if done[b]:
            continue
        stepped.append(row)
        if b in errors:
            row.state.finish("error", error=errors[b])
            continue
        count = 0
        for j, token in enumerate(tokens[b]):
            emit(row.state, token, emitted_lp[b][j], chosen_lp[b][j], cursors[b],
                 row_top(tops, row, b, positions[b][j]))
            row.context.append(token)
            count += 1
            if row.state.done:
                break
        drafted, kept = int(draft.lengths[b]), int(accepted[b])
        per_ledger.add(row.spec.ledger, output_tokens=count, drafted_tokens=drafted, accepted_tokens=kept,
                       rejected_tokens=drafted - kept, verify_steps=1)
    per_ledger.charge()
    return stepped


class Tally:
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
