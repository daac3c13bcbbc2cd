"""Prompt lookup: draft by copying what followed an earlier occurrence of the current suffix.

Saxena 2023, "Prompt lookup decoding" (transformers' ``prompt_lookup_num_tokens``); the same
idea as llama.cpp's lookup decoding. When the output quotes or edits its input (summaries,
code edits, retrieval-augmented answers) long stretches are copies, and the target accepts
them wholesale. Costs no model call: each row keeps an index from every n-gram of its
context to where it first (or last) occurred, updated with the new tokens only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.models.forward import Ledgers
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import LEVELS, Draft, DraftState, Verified

# What a copy after a match of 1, 2 and 3 or more tokens is worth, roughly, before a request has
# shown it (the cost model's class priors, `metaloom.speculative.acceptance`): the first drafted
# token's acceptance, and each next one's ratio to the one before. Medians over SmolLM2-135M,
# Qwen2.5-Coder-1.5B and Gemma 3 270M on `metaloom bench speculative`'s grounded and free prompts
# (`scripts/ngram_acceptance.py`): first tokens kept after a 1-token match 8-38% of the time,
# after 2 tokens 25-78%, after 3 tokens 59-95%.
MATCH_PRIORS = ((0.2, 0.5), (0.55, 0.6), (0.82, 0.9))


@dataclass(frozen=True)
class NgramDrafter:
    """Match the longest suffix of ``max_ngram`` .. ``min_ngram`` tokens and copy what followed
    its ``occurrence``: the first (default, as transformers: in an edit or summary the source
    text being copied comes first; measured 2.69 vs 2.55 tokens per target forward on the
    benchmark's prompts) or the most recent."""

    max_ngram: int = 3
    min_ngram: int = 1
    occurrence: str = "first"  # which earlier occurrence to copy from: "first" or "last" (most recent)
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidParameter("min_ngram/max_ngram", (self.min_ngram, self.max_ngram), "1 <= min_ngram <= max_ngram")
        if self.occurrence not in ("first", "last"):
            raise InvalidParameter("occurrence", self.occurrence, "'first' or 'last'")

    @property
    def class_priors(self) -> tuple[tuple[float, float], ...]:
        """The cost model's prior for each confidence class (`Draft.levels`: the matched length
        less ``min_ngram``): the first drafted token's acceptance and each next one's ratio to
        it, by the length matched (`MATCH_PRIORS`)."""
        return tuple(MATCH_PRIORS[min(n, len(MATCH_PRIORS)) - 1] for n in range(self.min_ngram, self.max_ngram + 1))

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> NgramState:
        return NgramState(self, [NgramIndex(self.occurrence == "first") for _ in contexts])


class NgramIndex:
    """n-gram -> the end positions (exclusive, ascending) of all its occurrences that have a
    continuation, updated with the new positions only. The chain copies after the first or the
    latest of them; the tree drafter (`metaloom.speculative.drafters.ngram_tree`) merges them all."""

    def __init__(self, first: bool = False) -> None:
        self.where: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # continuation positions e < indexed are in `where`
        self.first = first  # `lookup` copies after the earliest occurrence instead of the latest

    def update(self, context: Sequence[int], sizes: range) -> None:
        for e in range(max(self.indexed, 1), len(context)):
            for n in sizes:
                if e >= n:
                    self.where.setdefault(tuple(context[e - n:e]), []).append(e)
        self.indexed = max(self.indexed, len(context))

    def ends(self, context: Sequence[int], sizes: range) -> list[int]:
        """The ends of the longest suffix that occurred before (empty: none did)."""
        for n in reversed(sizes):
            if len(context) >= n:
                ends = self.where.get(tuple(context[len(context) - n:]))
                if ends:
                    return ends
        return []

    def lookup(self, context: Sequence[int], sizes: range, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the first (or latest) occurrence of the longest suffix."""
        return self.match(context, sizes, limit)[0]

    def match(self, context: Sequence[int], sizes: range, limit: int) -> tuple[list[int], int]:
        """`lookup`, and the length of the suffix matched (0: none)."""
        for n in reversed(sizes):
            if len(context) >= n:
                ends = self.where.get(tuple(context[len(context) - n:]))
                if ends:
                    e = ends[0] if self.first else ends[-1]
                    return list(context[e:e + limit]), n
        return [], 0


class NgramState:
    def __init__(self, drafter: NgramDrafter, rows: list[NgramIndex]) -> None:
        self.drafter = drafter
        self.rows = rows
        self.sizes = range(drafter.min_ngram, drafter.max_ngram + 1)

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        """Each row's copy, and as its confidence class the matched suffix's length (a copy after
        a three-token match is kept far more often than one after a single common token)."""
        drafts, levels = [], []
        for index, context, limit in zip(self.rows, contexts, limits, strict=True):
            index.update(context, self.sizes)
            tokens, n = index.match(context, self.sizes, limit) if limit > 0 else ([], 0)
            drafts.append(tokens)
            levels.append(min(max(n - self.drafter.min_ngram, 0), LEVELS - 1))
        return dataclasses.replace(Draft.from_lists(drafts), levels=tuple(levels))

    def observe(self, verified: Verified) -> None:
        pass

    def select(self, rows: Sequence[int]) -> NgramState:
        return NgramState(self.drafter, [self.rows[r] for r in rows])

    def join(self, other: DraftState) -> NgramState:
        assert isinstance(other, NgramState)
        return NgramState(self.drafter, self.rows + other.rows)
