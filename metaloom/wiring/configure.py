"""Build strategies and their components from string parameters (the command line, a config
file): each parameter is converted to the type its dataclass field or factory argument
declares; a parameter whose type is a component protocol (Scorer, Extractor, Utility,
Feedback, Strategy) names a registry entry, configured in turn by ``FIELD.PARAM`` values.

Unknown names and parameters raise `InvalidParameter` listing the valid ones: only the
parameters text can set (`settable`); sampling params come from the sampling flags, a
`Generator` parameter receives the model being run.

Two steps, each done once: `plan_strategy` reads the text (names, parameters, types, the
strategy's own value checks) into a `Plan` before any model loads, and `Plan.build` makes the
objects once the model is there (the model being run, a second model named by text, a task's
public tests are filled in then). `build_strategy` is both at once.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import json
import operator
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.sampling.params import SamplingParams
from metaloom.score.public_tests import PublicTests
from metaloom.score.verifier import load_callable
from metaloom.wiring.registry import KINDS, STRATEGIES, lookup

REQUIRED: Any = inspect.Parameter.empty
HIDDEN = frozenset({"name", "self", "cls"})  # labels, not behaviour


@dataclass(frozen=True)
class Param:
    name: str
    type: Any
    default: Any = REQUIRED  # a value, or REQUIRED
    factory: Callable[[], Any] | None = None  # a dataclass default_factory


def params_of(entry: Callable[..., Any]) -> list[Param]:
    """The configurable parameters of a class (its dataclass fields) or factory function."""
    if isinstance(entry, type) and dataclasses.is_dataclass(entry):
        hints = typing.get_type_hints(entry)
        out = []
        for f in dataclasses.fields(entry):
            if f.init and f.name not in HIDDEN:
                factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
                default = REQUIRED if f.default is dataclasses.MISSING else f.default
                out.append(Param(f.name, hints[f.name], default, factory))
        return out
    hints = typing.get_type_hints(entry)
    return [Param(p.name, hints.get(p.name, str), p.default) for p in inspect.signature(entry).parameters.values()
            if p.name not in HIDDEN and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _options(t: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed)."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return (args[0] if len(args) == 1 else functools.reduce(operator.or_, args)), len(args) < len(typing.get_args(t))
    return t, False


def is_generator(t: Any) -> bool:
    return _options(t)[0] is Generator


def kind_of(t: Any) -> tuple[str, Callable[[], Mapping[str, Any]]] | None:
    return KINDS.get(_options(t)[0])


def settable(t: Any) -> bool:
    """Whether a parameter of type ``t`` can be given as text (`convert` takes it): not a
    `SamplingParams` (the sampling flags set it), nor the `Generator` being run, nor any
    other structured value."""
    t, nullable = _options(t)
    if t is Generator:  # a second model (a drafter), named as a model; never the one being run
        return nullable
    if kind_of(t) is not None or t in (bool, int, float, str) or t is collections.abc.Callable:
        return True
    if typing.get_origin(t) is tuple:
        return settable(typing.get_args(t)[0])
    return typing.get_origin(t) is collections.abc.Callable


def _not_settable(where: str, value: str, t: Any) -> InvalidParameter:
    if _options(t)[0] is SamplingParams:
        return InvalidParameter(where, value, "sampling flags instead (--temperature, --top-p, --max-tokens, --seed, ...)")
    if is_generator(t):
        return InvalidParameter(where, value, "nothing: it is the model being run")
    return InvalidParameter(where, value, f"a parameter settable from text (its type is {t})")


def convert(value: str, t: Any, where: str, groups: Mapping[str, dict[str, str]], context: Mapping[str, Any]) -> Any:
    """``value`` as type ``t``; ``where`` names the parameter in errors."""
    t, nullable = _options(t)
    if nullable and value.lower() in ("none", "null"):
        return None
    if t is Generator:  # a second model: the command loads it as it loaded the first (a model id remotely)
        return _SecondModel(value, where)
    kind = kind_of(t)
    if kind is not None:
        label, table = kind
        field_name = where.rsplit(".", 1)[-1]
        return plan(field_name, lookup(label, table(), value), groups.get(field_name, {}), groups, context)
    if t is bool:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise InvalidParameter(where, value, "true or false")
        return value.lower() in ("true", "1", "yes")
    if t in (int, float, str):
        if t is str and value.startswith('"'):
            return _json(value, where, str)
        try:
            return t(value)
        except ValueError as exc:
            raise InvalidParameter(where, value, f"a value of type {t.__name__}") from exc
    if typing.get_origin(t) is tuple:
        item = typing.get_args(t)[0]
        raw = _json(value, where, list) if value.startswith("[") else [v for v in value.split(",") if v]
        texts = [v if isinstance(v, str) else json.dumps(v) for v in raw]
        return tuple(texts) if item is str else tuple(convert(v, item, where, groups, context) for v in texts)
    if t is collections.abc.Callable or typing.get_origin(t) is collections.abc.Callable:
        return load_callable(value)
    raise _not_settable(where, value, t)


def _json(value: str, where: str, kind: type) -> Any:
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidParameter(where, value, f"valid JSON ({exc})") from exc
    if not isinstance(out, kind):
        raise InvalidParameter(where, value, f"a JSON {kind.__name__}")
    return out


@dataclass(frozen=True)
class _SecondModel:
    """A second model named by text (a drafter), loaded at build time as the first was."""

    name: str
    where: str

    def make(self, context: Mapping[str, Any]) -> Any:
        loader = context.get("load_generator")
        if loader is None:
            raise InvalidParameter(self.where, self.name, "no model here: a second model is given to metaloom run or "
                                                          "metaloom eval")
        return loader(self.name)


@dataclass(frozen=True)
class _FromContext:
    """A value the caller supplies at build time: the model being run, or a task's public tests."""

    key: str
    label: str

    def make(self, context: Mapping[str, Any]) -> Any:
        if self.key == "generator":
            if "generator" not in context:
                raise InvalidParameter(self.label, None, "a model to run: build it with context['generator']")
            return context["generator"]
        if context.get(self.key) is None:
            # the problem's visible tests come from the task being evaluated, never from text
            raise InvalidParameter(self.label, None, "a task that shows tests: public tests come from the problem "
                                   "in metaloom eval (--task humaneval); elsewhere name the tests (tests feedback, "
                                   "execution scorer)")
        return context[self.key]


@dataclass(frozen=True)
class Plan:
    """A strategy or component read from text and checked, not yet made: ``entry`` and its
    converted ``values`` (a component's own `Plan`, or what the caller supplies at build time)."""

    label: str
    entry: Callable[..., Any]
    values: Mapping[str, Any]

    def build(self, context: Mapping[str, Any] | None = None) -> Any:
        """The object, made once: ``context["generator"]`` is the model being run (judges and
        critics use it), ``context["load_generator"](name)`` loads a second model,
        ``context["public_tests"]`` the task's visible tests."""
        context = context or {}
        return self.entry(**{k: _make(v, context) for k, v in self.values.items()})


def _make(value: Any, context: Mapping[str, Any]) -> Any:
    if isinstance(value, Plan):
        return value.build(context)
    if isinstance(value, (_SecondModel, _FromContext)):
        return value.make(context)
    if isinstance(value, tuple):
        return tuple(_make(v, context) for v in value)
    return value


def _planned(value: Any) -> bool:
    """Whether ``value`` is made only at build time (what a value check cannot see yet)."""
    return isinstance(value, (Plan, _SecondModel, _FromContext)) or (
        isinstance(value, tuple) and any(_planned(v) for v in value))


def plan(label: str, entry: Callable[..., Any], params: Mapping[str, str], groups: Mapping[str, dict[str, str]],
         context: Mapping[str, Any]) -> Plan:
    """``entry`` with ``params`` converted to its declared types, checked and not yet called.
    ``context["inspect"](label, values)`` sees every component's converted values (those made at
    build time as None). A dataclass entry's own value checks (``__post_init__``) run too, on a
    throwaway copy made with the components' defaults, when it can be made without them."""
    declared = params_of(entry)
    types = {p.name: p.type for p in declared}
    names = [p.name for p in declared if settable(p.type)]  # only what text can set is offered
    for key, value in params.items():
        if key not in types:
            raise InvalidParameter(f"{label}.{key}", value, f"one of {names}")
        if key not in names:
            raise _not_settable(f"{label}.{key}", value, types[key])
    values: dict[str, Any] = {}
    for p in declared:
        if is_generator(p.type) and p.default is REQUIRED:
            values[p.name] = _FromContext("generator", f"{label}.{p.name}")  # judges and critics use the model run
        elif p.type is PublicTests:
            values[p.name] = _FromContext("public_tests", label)
        elif p.name in params:
            values[p.name] = convert(params[p.name], p.type, f"{label}.{p.name}", groups, context)
        elif p.default is REQUIRED and p.factory is None:
            raise InvalidParameter(f"{label}.{p.name}", None, f"a value (--{label}.{p.name} is required)")
    known = {k: None if _planned(v) else v for k, v in values.items()}
    inspect_values = context.get("inspect")  # a caller's own checks of the converted values (the server's limits)
    if inspect_values is not None:
        inspect_values(label, known)
    # (``context["check"]`` False: the caller builds at once, and building runs the same checks)
    if context.get("check", True) and isinstance(entry, type) and dataclasses.is_dataclass(entry):
        given = {k: v for k, v in known.items() if v is not None}
        required = {p.name for p in declared if p.default is REQUIRED and p.factory is None}
        if required <= given.keys():
            entry(**given)
    return Plan(label, entry, values)


def build(label: str, entry: Callable[..., Any], params: Mapping[str, str], groups: Mapping[str, dict[str, str]],
          context: Mapping[str, Any]) -> Any:
    """`plan` then `Plan.build`; with ``context["dry"]`` only the plan (None is returned)."""
    planned = plan(label, entry, params, groups, context)
    return None if context.get("dry") else planned.build(context)


def plan_strategy(name: str, params: Mapping[str, str], groups: Mapping[str, dict[str, str]] | None = None,
                  context: Mapping[str, Any] | None = None) -> Plan:
    """The strategy ``name`` read from ``params`` and checked, before any model loads;
    ``groups[FIELD]`` configure the component chosen for field FIELD (``--scorer.path ...``).
    Make it with `Plan.build` once the model is there."""
    groups = dict(groups or {})
    used = _component_fields(STRATEGIES, name, params, groups)
    for group in groups:
        if groups[group] and group not in used:
            raise InvalidParameter(f"{group}.*", groups[group], f"parameters of a component chosen by --strategy.{group} "
                                   f"(or by a chosen component's {group!r} parameter)")
    return plan("strategy", lookup("strategy", STRATEGIES, name), params, groups, context or {})


def build_strategy(name: str, params: Mapping[str, str], groups: Mapping[str, dict[str, str]] | None = None,
                   context: Mapping[str, Any] | None = None) -> Any:
    """`plan_strategy` and `Plan.build` at once (``context["dry"]``: the plan's checks only, None)."""
    context = context or {}
    dry = bool(context.get("dry"))
    planned = plan_strategy(name, params, groups, {**context, "check": dry})
    return None if dry else planned.build(context)


def _component_fields(table: Mapping[str, Any], name: str, params: Mapping[str, str],
                      groups: Mapping[str, dict[str, str]]) -> set[str]:
    """The field names that choose a component, recursively, so stray groups are caught."""
    if name not in table:
        return set()
    from metaloom.wiring.registry import resolve

    used: set[str] = set()
    for p in params_of(resolve(table[name])):
        kind = kind_of(p.type)
        if kind is not None and p.name in params:
            used.add(p.name)
            used |= _component_fields(kind[1](), params[p.name], groups.get(p.name, {}), groups)
    return used
