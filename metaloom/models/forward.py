"""The one place a model forward is charged to a ledger.

A forward may serve rows that belong to different ledgers (a decode loop shared by several
requests). FLOPs are linear in the new tokens, the attended keys and the logit rows
(`metaloom.models.flops`), so each row's share is exact: a ledger is charged the FLOPs of its
own rows and one forward pass per forward its rows took part in.

A model made of several streams (`metaloom.decode.contrastive.LockstepPair`) reports them
through ``cost_streams(cache)``: each stream is charged with its own cache's lengths, so two
models stepped together cost exactly what each costs alone.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch

from metaloom.errors import BudgetExceeded, UnsupportedModel
from metaloom.ledger import Ledger
from metaloom.models.flops import attended_keys
from metaloom.models.protocols import KVCache, LanguageModel

Ledgers = Ledger | Sequence[Ledger]  # one for the whole batch, or one per row


def _streams(model: LanguageModel, cache: KVCache) -> list[tuple[Any, list[int]]]:
    """(model, per-row start lengths) of each stream a forward runs."""
    streams = getattr(model, "cost_streams", None)
    if streams is not None:
        return [(m, _lengths(c)) for m, c in streams(cache)]
    return [(model, _lengths(cache))]


def _lengths(cache: KVCache) -> list[int]:
    """A cache's row lengths as ints: from the host where the cache keeps them there (a paged
    cache on a GPU would otherwise copy them to the device and back: two synchronisations)."""
    host = getattr(cache, "host_lengths", None)
    return host().tolist() if host is not None else cache.lengths.tolist()


def charge_forward(model: LanguageModel, streams: list[tuple[Any, list[int]]], counts: list[int], logit_rows: list[int],
                   ledger: Ledgers) -> None:
    """Charge one forward (every stream) whose row b added ``counts[b]`` tokens and produced
    ``logit_rows[b]`` rows of logits. A single ledger raises `BudgetExceeded` after recording
    (the caller stops); per-row ledgers never raise here — the decode loop asks each ledger
    afterwards (`Ledger.over_budget`) and stops only that ledger's rows."""
    if isinstance(ledger, Ledger):
        flops = sum(m.flops(new_tokens=sum(counts), attended=attended_keys(starts, counts), logit_rows=sum(logit_rows))
                    for m, starts in streams)
        ledger.charge(forward_passes=len(streams), flops=flops)
        return
    by_ledger: dict[int, tuple[Ledger, list[int]]] = {}
    for row, owner in enumerate(ledger):
        by_ledger.setdefault(id(owner), (owner, []))[1].append(row)
    for owner, rows in by_ledger.values():
        c = [counts[r] for r in rows]
        flops = sum(m.flops(new_tokens=sum(c), attended=attended_keys([starts[r] for r in rows], c),
                            logit_rows=sum(logit_rows[r] for r in rows)) for m, starts in streams)
        with contextlib.suppress(BudgetExceeded):
            owner.charge(forward_passes=len(streams), flops=flops)


def charge_rows(ledger: Ledgers, rows: int, **per_row: float) -> None:
    """Charge ``per_row`` amounts for each of ``rows`` rows: to one ledger (raising on a budget,
    as `Ledger.charge`), or to each row's own ledger (never raising, see `charge_forward`)."""
    if isinstance(ledger, Ledger):
        ledger.charge(**{k: v * rows for k, v in per_row.items()})
        return
    counts: dict[int, tuple[Ledger, int]] = {}
    for owner in ledger:
        counts[id(owner)] = (owner, counts.get(id(owner), (owner, 0))[1] + 1)
    for owner, n in counts.values():
        with contextlib.suppress(BudgetExceeded):
            owner.charge(**{k: v * n for k, v in per_row.items()})


def charged_forward(model: LanguageModel, tokens: torch.Tensor, cache: KVCache, ledger: Ledgers, *,
                    valid: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
    """`model.forward` plus a ledger charge: one forward pass and its FLOPs (see
    `metaloom.models.flops`), counting only the valid tokens of each row."""
    b, t = tokens.shape
    counts = valid.tolist() if valid is not None else [t] * b
    streams = _streams(model, cache)
    logits = model.forward(tokens, cache, valid=valid, last_only=last_only)
    charge_forward(model, streams, counts, [1] * b if last_only else counts, ledger)
    return logits


def takes_trees(model: Any) -> bool:
    """Whether ``model``'s ``forward`` takes a token-tree mask (``tree``)."""
    return _class_takes_trees(cast(Hashable, type(model)))  # a class is hashable; mypy reads type[Any] as not


@functools.cache
def _class_takes_trees(model_type: Hashable) -> bool:
    """Read once per class, not every verify step (`inspect.signature` costs tens of microseconds)."""
    forward = getattr(model_type, "forward", None)
    return forward is not None and "tree" in inspect.signature(forward).parameters


def charged_forward_both(model: LanguageModel, tokens: torch.Tensor, cache: KVCache, ledger: Ledgers, *,
                         valid: torch.Tensor | None = None, last_only: bool = False,
                         hidden: bool = False, tree: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`charged_forward` that also returns what the decode loop needs besides the raw logits:
    (raw logits [B, T, V], the scores it decodes from [B, T, V], final hidden states [B, T, d]
    or None). For a plain model the scores are the logits; a model with ``forward_both`` (two
    streams combined) returns its primary stream's logits and the combination; ``hidden``
    asks a model with ``forward_hidden`` (the native model) for its hidden states; ``tree`` [B,
    T, T]: a token-tree verify block (`metaloom.speculative.tree`; the native model only). The
    FLOPs are charged as for a causal block of T (a tree's nodes attend fewer of the block's keys:
    an overcount of at most T^2 / 2 key reads a layer)."""
    b, t = tokens.shape
    if tree is not None:
        if getattr(model, "forward_both", None) is not None:
            raise UnsupportedModel(f"token trees verify through one native model, not {type(model).__name__} "
                                   "(two streams)")
        if not takes_trees(model):
            raise UnsupportedModel(f"{type(model).__name__} takes no token trees (the native engine does)")
        tree_states = None
        if hidden:  # speculator heads drafting trees read the hidden state at the accepted path's end
            forward_hidden = model.forward_hidden  # type: ignore[attr-defined]
            raw, tree_states = forward_hidden(tokens, cache, valid=valid, last_only=last_only, tree=tree)
        else:
            raw = model.forward(tokens, cache, valid=valid, last_only=last_only, tree=tree)  # type: ignore[call-arg]
        charge_forward(model, _streams(model, cache), valid.tolist() if valid is not None else [t] * b,
                       [1] * b if last_only else (valid.tolist() if valid is not None else [t] * b), ledger)
        return raw, raw, tree_states
    counts = valid.tolist() if valid is not None else [t] * b
    if valid is not None and valid.device != tokens.device and not getattr(model, "host_valid", False):
        valid = valid.to(tokens.device)  # a host ``valid`` spares a model that reads it on the host a device wait
    streams = _streams(model, cache)
    states = None
    both = getattr(model, "forward_both", None)
    if both is not None:
        raw, scores = both(tokens, cache, valid=valid, last_only=last_only)
    elif hidden:
        raw, states = model.forward_hidden(tokens, cache, valid=valid, last_only=last_only)  # type: ignore[attr-defined]
        scores = raw
    else:
        raw = scores = model.forward(tokens, cache, valid=valid, last_only=last_only)
    charge_forward(model, streams, counts, [1] * b if last_only else counts, ledger)
    return raw, scores, states


def charged_forward_hidden(model: LanguageModel, tokens: torch.Tensor, cache: KVCache, ledger: Ledgers, *,
                           valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`charged_forward` for a model with ``forward_hidden`` (the native model): (logits [B, T, V],
    final hidden states [B, T, d]), charged the same."""
    raw, _, states = charged_forward_both(model, tokens, cache, ledger, valid=valid, hidden=True)
    assert states is not None
    return raw, states
