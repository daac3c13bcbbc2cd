"""Strategy specs as one string: ``NAME`` or ``NAME@param=v,param=v`` — the syntax of
`metaloom eval`'s ``--strategies``, of the server's model aliases (``NAME@...:MODEL``) and of
the config ``metaloom eval --select`` prints. ``FIELD.PARAM=v`` configures the component a
field chose (``best_of_n@scorer=judge,scorer.template=...``), as ``--FIELD.PARAM`` does for
``metaloom run``. ``budget.FIELD=LIMIT`` caps the run's usage (``rebase@n=8,budget.flops=8e12``,
as ``--budget`` does): the strategy stops cleanly at the limit with the best it has, so a
sweep can hold every strategy to the same FLOPs. A value holding a comma is written as JSON
(``delimiter=["\\n\\n", "##"]``): commas inside brackets or quotes do not split."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.ledger import Budget, parse_budget

FORM = "NAME or NAME@param=value,param=value"
BUDGET = "budget"  # the group that caps the run's usage, not a component


@dataclass(frozen=True)
class Spec:
    """A parsed spec: the strategy ``name``, its own ``params`` and its components' ``groups``."""

    name: str
    params: Mapping[str, str] = field(default_factory=dict)
    groups: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def text(self) -> str:
        """The canonical spec string (parameters in the order given)."""
        items = [f"{k}={v}" for k, v in self.params.items()]
        items += [f"{g}.{k}={v}" for g, ps in self.groups.items() for k, v in ps.items()]
        return self.name + ("@" + ",".join(items) if items else "")

    def build(self, context: Mapping[str, Any]) -> Any:
        """The strategy object (``context`` as `build_strategy` takes it: ``{"generator": g}``
        or ``{"dry": True}`` to check names, parameters and types only)."""
        from metaloom.wiring.configure import build_strategy

        groups = {g: dict(p) for g, p in self.groups.items() if g != BUDGET}
        return build_strategy(self.name, dict(self.params), groups, context)

    def budget_items(self) -> list[str]:
        """The ``budget.FIELD=LIMIT`` items as ``FIELD=LIMIT`` texts (what ``--budget`` takes)."""
        return [f"{k}={v}" for k, v in self.groups.get(BUDGET, {}).items()]

    def budget(self) -> Budget | None:
        """The run's `Budget` (None: unlimited); a bad limit is an `InvalidParameter` naming
        ``budget.FIELD``."""
        items = self.budget_items()
        return parse_budget(items) if items else None


def _items(text: str, where: str) -> list[str]:
    """``text`` split at top-level commas (not inside [] {} () or quotes)."""
    out, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            if c == quote and text[i - 1] != "\\":
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise InvalidParameter(where, text, FORM + " (an unclosed bracket or quote)")
    out.append(text[start:])
    return [s for s in out if s.strip()]


def parse_spec(text: str, where: str = "strategy") -> Spec:
    """A `Spec` from ``NAME@param=v,...``; a malformed string is an `InvalidParameter` naming
    ``where`` (the names and values are checked by `Spec.build`)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidParameter(where, text, FORM)
    name, _, rest = text.strip().partition("@")
    if not name or any(c in name for c in "=,. "):
        raise InvalidParameter(where, text, FORM)
    params: dict[str, str] = {}
    groups: dict[str, dict[str, str]] = {}
    for item in _items(rest, where):
        key, eq, value = item.partition("=")
        key = key.strip()
        group, dot, sub = key.partition(".")
        if not eq or not key or (dot and (not group or not sub)):
            raise InvalidParameter(where, text, f"{FORM} (not param=value: {item!r})")
        target = groups.setdefault(group, {}) if dot else params
        name_in = sub if dot else key
        if name_in in target:
            raise InvalidParameter(f"{where}.{key}", value, "one value (given twice)")
        target[name_in] = value.strip()
    return Spec(name, params, groups)


def check_spec(text: str, where: str = "strategy") -> Spec:
    """`parse_spec`, then the names, parameters and types checked without building anything
    (no model needed); errors name ``where``."""
    spec = parse_spec(text, where)
    try:
        spec.budget()
        spec.build({"dry": True})
    except InvalidParameter as exc:
        raise InvalidParameter(f"{where} {text!r}: {exc.name}", exc.value, exc.allowed) from exc
    return spec
