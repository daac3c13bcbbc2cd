"""The one place a model forward is charged to a ledger."""

from __future__ import annotations

import torch

from metaloom.ledger import Ledger
from metaloom.models.flops import attended_keys
from metaloom.models.protocols import KVCache, LanguageModel


def charged_forward(model: LanguageModel, tokens: torch.Tensor, cache: KVCache, ledger: Ledger, *,
                    valid: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
    """`model.forward` plus a ledger charge: one forward pass and its FLOPs (see
    `metaloom.models.flops`), counting only the valid tokens of each row."""
    b, t = tokens.shape
    counts = valid.tolist() if valid is not None else [t] * b
    starts = cache.lengths.tolist()
    logits = model.forward(tokens, cache, valid=valid, last_only=last_only)
    ledger.charge(forward_passes=1, flops=model.flops(
        new_tokens=sum(counts), attended=attended_keys(starts, counts),
        logit_rows=b if last_only else sum(counts)))
    return logits


def charged_forward_hidden(model: LanguageModel, tokens: torch.Tensor, cache: KVCache, ledger: Ledger, *,
                           valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`charged_forward` for a model with ``forward_hidden`` (the native model): (logits [B, T, V],
    final hidden states [B, T, d]), charged the same."""
    b, t = tokens.shape
    counts = valid.tolist() if valid is not None else [t] * b
    starts = cache.lengths.tolist()
    logits, hidden = model.forward_hidden(tokens, cache, valid=valid)  # type: ignore[attr-defined]
    ledger.charge(forward_passes=1, flops=model.flops(
        new_tokens=sum(counts), attended=attended_keys(starts, counts), logit_rows=sum(counts)))
    return logits, hidden
