"""Honest accounting: a `Ledger` is charged for every model call; `Usage` is its snapshot.

The ledger is explicit state: callers create one and pass it down; nothing is global.
Child ledgers (for nested strategies) forward every charge to their parent, so a parent's
totals always include what its children spent. A ledger tree shares one lock, so threads may
charge any of its ledgers at once (a server's requests, a strategy's parallel calls): each
charge lands in every ancestor atomically, and its budget check sees the totals it made.

Token fields follow the OpenAI convention:
- ``input_tokens``: prompt tokens the request supplied (counted once per request, even for
  ``n > 1`` samples that share the prompt);
- ``cached_tokens``: the part of ``input_tokens`` that was not computed because its KV entries
  were already present (prefix cache);
- ``output_tokens``: generated tokens, an end-of-sequence token included.

Every figure but one is a count, and usages add field by field. ``kv_bytes_peak`` is a high-water
mark (`PEAKS`): the most KV-cache bytes the rows charged to a ledger held at once — the distinct
KV slots of those rows (keys shared by forks of one prompt, or handed over by the prefix cache,
counted once) times the KV pool's bytes per slot; several streams (the amateur of contrastive
decoding, a draft model) add their own. Two usages combine by taking the larger peak: right for
calls made one after another (a strategy's rounds, a chain), an undercount for calls that run at
the same time on different batches (a server's concurrent requests charged to one parent ledger,
a strategy's threads), whose memory adds up while the ledger keeps only the largest. Rows of one
ledger decoded in one batch are measured together, so a `generate` of several requests on one
ledger reports what they held together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import threading
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import BudgetExceeded, Interrupted, InvalidParameter


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    forward_passes: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    scorer_calls: int = 0  # calls to a Scorer / StepScorer / Utility (verifiers, reward models, judges)
    # speculative decoding (`metaloom.speculative`): draft tokens by verification outcome, and
    # row-verifications (one target forward verifying 3 rows counts 3)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    verify_steps: int = 0
    # the most KV-cache bytes the charge's rows held at once: a high-water mark, combined by max
    # (see the module docstring), never summed
    kv_bytes_peak: int = 0
    # figures a charge could not count (a remote server reports no forward passes): reported as
    # None, never as a misleading 0; and figures partly estimated (FLOPs from a parameter count)
    unknown: frozenset[str] = frozenset()
    estimated: frozenset[str] = frozenset()

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def accepted_per_step(self) -> float | None:
        """Mean draft tokens accepted per verification step (each step also emits one token
        drawn from the target, so tokens per step is one more); None without speculation."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else None

    def __add__(self, other: Usage) -> Usage:
        """Counts add; a peak is the larger of the two (see the module docstring)."""
        amounts = {name: getattr(self, name) + getattr(other, name) for name in SUMMED}
        for name in PEAKS:
            amounts[name] = max(getattr(self, name), getattr(other, name))
        return Usage(**amounts, unknown=self.unknown | other.unknown,  # type: ignore[arg-type]
                     estimated=self.estimated | other.estimated)

    def since(self, before: Usage) -> Usage:
        """What was charged after ``before`` (an earlier snapshot of the same ledger): counts are
        differences; a peak is known where it rose or where there was none before (the part
        after ``before`` then reached exactly this peak), else it is unknown: a later part that
        stayed under the earlier peak could have held anything up to it, and subtracting peaks
        means nothing."""
        fell = frozenset(name for name in PEAKS if 0 < getattr(self, name) <= getattr(before, name))
        amounts = {name: 0 if name in fell else getattr(self, name) if name in PEAKS
                   else getattr(self, name) - getattr(before, name) for name in COUNTED}
        return Usage(**amounts, unknown=self.unknown | fell, estimated=self.estimated)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """Every figure (None where it is unknown), and ``estimated``: the figures that are estimates."""
        out: dict[str, Any] = {name: None if name in self.unknown else getattr(self, name) for name in COUNTED}
        if self.estimated:
            out["estimated"] = sorted(self.estimated)
        return out


COUNTED = tuple(f.name for f in dataclasses.fields(Usage) if f.name not in ("unknown", "estimated"))
# the figures that are high-water marks, not counts: combined by max, never summed or subtracted
PEAKS = ("kv_bytes_peak",)
SUMMED = tuple(name for name in COUNTED if name not in PEAKS)


@dataclass(frozen=True)
class Budget:
    """Upper limits on any `Usage` field (one field here per field there); ``None`` means unlimited."""

    input_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    forward_passes: int | None = None
    flops: float | None = None
    seconds: float | None = None
    scorer_calls: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    rejected_tokens: int | None = None
    verify_steps: int | None = None
    kv_bytes_peak: int | None = None  # a cap on memory: the rows of a ledger past it end ("budget")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            limit = getattr(self, f.name)
            if limit is None:
                continue
            whole = f.name not in ("flops", "seconds")
            if isinstance(limit, bool) or not isinstance(limit, (int, float)) or (whole and not isinstance(limit, int)):
                raise InvalidParameter(f"budget.{f.name}", limit, "an integer >= 0" if whole else "a number >= 0")
            if not math.isfinite(limit) or limit < 0:
                raise InvalidParameter(f"budget.{f.name}", limit, "a finite limit >= 0 (None for no limit)")

    def check(self, usage: Usage) -> None:
        for f in dataclasses.fields(self):
            limit = getattr(self, f.name)
            if limit is None:
                continue
            if f.name in usage.unknown:  # a limit that cannot be enforced is an error, not a silent pass
                raise InvalidParameter(f"budget.{f.name}", limit, f"a limit on figures this generator counts "
                                                                  f"({f.name} are unknown here)")
            if getattr(usage, f.name) > limit:
                raise BudgetExceeded(f.name, limit, getattr(usage, f.name))

    def exceeded(self, usage: Usage) -> bool:
        """Whether ``usage`` passes a limit (`check` without the exception)."""
        try:
            self.check(usage)
        except BudgetExceeded:
            return True
        return False


def parse_budget(items: Sequence[str]) -> Budget:
    """A `Budget` from ``FIELD=LIMIT`` texts: a whole number for count fields, a number for
    ``flops`` and ``seconds``, finite and >= 0, each field once; else `InvalidParameter`
    naming ``budget.FIELD``."""
    hints = typing.get_type_hints(Budget)
    fields = [f.name for f in dataclasses.fields(Budget)]
    limits: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, text = key.strip(), value.strip()
        if not sep or key not in fields:
            raise InvalidParameter("budget", item, f"FIELD=LIMIT with FIELD one of {fields}")
        if key in limits:
            raise InvalidParameter(f"budget.{key}", value, f"one limit (already {limits[key]})")
        whole = int in typing.get_args(hints[key])
        allowed = "a whole number >= 0" if whole else "a finite number >= 0"
        limit: float = math.nan
        if whole and re.fullmatch(r"[-+]?\d+", text):
            limit = int(text)
        elif not whole:
            with contextlib.suppress(ValueError):  # not a number: stays nan
                limit = float(text)
        if not math.isfinite(limit) or limit < 0:
            raise InvalidParameter(f"budget.{key}", value, allowed)
        limits[key] = limit
    return Budget(**limits)  # type: ignore[arg-type]


@dataclass
class Ledger:
    """Mutable accumulator of `Usage`, optionally capped by a `Budget` and chained to a parent.
    Safe to charge from several threads (one lock per ledger tree)."""

    budget: Budget | None = None
    parent: Ledger | None = None
    usage: Usage = field(default_factory=Usage)
    lock: threading.RLock = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    # hears each trace event of the runs charged here or below, as it happens (the server streams
    # them as progress); it must return quickly and not raise
    listener: Callable[[str, dict[str, Any]], None] | None = field(default=None, repr=False, compare=False)
    # asked at every check (each charge): True stops the run charged here or below with
    # `Interrupted`; for runs that own their loop (beam search), which have no other way out
    stop: Callable[[], bool] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InvalidParameter("budget", self.budget, "a Budget")
        if self.lock is None:
            self.lock = self.parent.lock if self.parent is not None else threading.RLock()

    def charge(self, **amounts: float | frozenset[str]) -> None:
        """Add ``amounts`` (names of `Usage` fields; ``unknown`` / ``estimated``: the figures
        this charge could not count / estimated) here and in every ancestor.

        Raises `BudgetExceeded` *after* recording the charge: the work was done, so it is
        reported; the caller stops before doing more.
        """
        delta = Usage(**amounts)  # type: ignore[arg-type]
        with self.lock:
            for ledger in self.chain():
                ledger.usage = ledger.usage + delta
            self.check()

    def chain(self) -> Iterator[Ledger]:
        """This ledger, then each ancestor up to the root."""
        ledger: Ledger | None = self
        while ledger is not None:
            yield ledger
            ledger = ledger.parent

    def check(self) -> None:
        """Raise `BudgetExceeded` if this ledger or an ancestor is over its budget, `Interrupted`
        if one of them was told to `stop`."""
        with self.lock:
            for ledger in self.chain():
                if ledger.stop is not None and ledger.stop():
                    raise Interrupted("the run was stopped from outside")
                if ledger.budget is not None:
                    ledger.budget.check(ledger.usage)

    def over_budget(self) -> bool:
        """Whether this ledger or an ancestor is already over a budget limit (a `stop` is no
        budget: only `check` asks it)."""
        with self.lock:
            return any(ledger.budget is not None and ledger.budget.exceeded(ledger.usage) for ledger in self.chain())

    def notify(self, kind: str, data: dict[str, Any]) -> None:
        """Tell the listeners of this ledger and its ancestors about a trace event."""
        for ledger in self.chain():
            if ledger.listener is not None:
                ledger.listener(kind, data)

    def child(self, budget: Budget | None = None) -> Ledger:
        return Ledger(budget=budget, parent=self)
