"""One declaration per sampler parameter: the `SamplingParams` field carries, in its metadata,
everything else that is said about it — the pipeline step that reads it, how it is validated,
its CLI flag's help, and the value a remote server is probed with. The CLI flags
(`metaloom.commands.common`), the pipeline's per-row columns (`metaloom.sampling.pipeline`),
`SamplingParams.adapters` and the remote feature probe (`metaloom.generator.remote.detect`) are
all read from these declarations, so a new sampler is one field here and its function in the
pipeline (docs/contributing.md walks through it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter

# check(name, value, params): raise InvalidParameter naming the parameter, never clamp
Check = Callable[[str, Any, Any], None]


@dataclass(frozen=True)
class Knob:
    """What a sampler parameter is, beside its `SamplingParams` field.

    ``adapter``: the pipeline step that reads it (a name in `SamplingParams.adapters`; None for
    temperature, which every sampled row uses). ``switch``: a value other than the field's
    default turns that step on (its other parameters only tune it). ``greedy_too``: the step
    acts on greedy rows too (penalties before temperature; everything after temperature is
    skipped for greedy rows). ``column``: the pipeline stacks the field into a per-row tensor
    (False for values it reads another way). ``help``: the CLI flag's help (the flag is the
    field name with dashes; None: no plain flag). ``probe``: a valid non-default value a
    remote server is asked to accept (None: OpenAI's own field, not probed)."""

    adapter: str | None
    check: Check
    help: str | None
    probe: Any = None
    switch: bool = True
    greedy_too: bool = False
    column: bool = True


def knob(default: Any, *, adapter: str | None, check: Check, help: str | None, probe: Any = None,
         switch: bool = True, greedy_too: bool = False, column: bool = True) -> Any:
    """A `SamplingParams` field declared with its `Knob`."""
    return dataclasses.field(default=default, metadata={"knob": Knob(adapter, check, help, probe, switch,
                                                                      greedy_too, column)})


def knobs(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Knob]]:
    """The declared sampler parameters of ``cls``, in field order."""
    for f in dataclasses.fields(cls):
        k = f.metadata.get("knob")
        if isinstance(k, Knob):
            yield f, k


# ---- checks: each returns a `Check`; the messages say what is allowed

def finite(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameter(name, value, "a finite number")


def integer(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidParameter(name, value, "an integer")


def in_range(lo: float, hi: float, allowed: str, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number in [lo, hi] (an open end excluded)."""

    def check(name: str, value: Any, _: Any) -> None:
        finite(name, value)
        if value < lo or (lo_open and value == lo) or value > hi or (hi_open and value == hi):
            raise InvalidParameter(name, value, allowed)

    return check


def at_least(lo: int, allowed: str) -> Check:
    """An integer >= lo."""

    def check(name: str, value: Any, _: Any) -> None:
        integer(name, value)
        if value < lo:
            raise InvalidParameter(name, value, allowed)

    return check


def one_of(values: tuple[int, ...], allowed: str) -> Check:
    """An integer among ``values``."""

    def check(name: str, value: Any, _: Any) -> None:
        integer(name, value)
        if value not in values:
            raise InvalidParameter(name, value, allowed)

    return check


def strings(name: str, value: Any, _: Any) -> None:
    """A tuple of non-empty strings."""
    if isinstance(value, str) or not all(isinstance(s, str) and s for s in value):
        raise InvalidParameter(name, value, "a tuple of non-empty strings")
