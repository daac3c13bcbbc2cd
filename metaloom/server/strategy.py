"""A strategy per request: the ``metaloom`` object of a body, or a model alias
``NAME@param=v,param=v:MODEL`` (the syntax `metaloom eval` takes for strategy specs)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Generator
from metaloom.ledger import Budget
from metaloom.meta.types import Strategy
from metaloom.sampling.params import SamplingParams
from metaloom.server.bodies import StrategyOptions
from metaloom.server.errors import ApiError
from metaloom.server.limits import Limits
from metaloom.server.protocol import strategy_params

_DEFAULT = SamplingParams()


@dataclass(frozen=True)
class StrategyCall:
    """A strategy as one request asked for it, checked (names, parameters, types, budget)."""

    name: str
    params: dict[str, str] = field(default_factory=dict)
    groups: dict[str, dict[str, str]] = field(default_factory=dict)
    budget: Budget | None = None
    trace: bool = False
    origin: str = "metaloom.params"  # where the request set the parameters: the body's object or the model alias

    def __post_init__(self) -> None:
        from metaloom.wiring.configure import build_strategy

        try:  # names, parameters, types and the strategy's own value checks, before any compute
            build_strategy(self.name, self.params, self.groups, {"dry": True})
        except InvalidParameter as exc:  # named as the request names it
            name = exc.name.removeprefix("strategy.")
            where = "metaloom.strategy" if name == "strategy" else f"metaloom.params.{name}"
            raise InvalidParameter(where, exc.value, exc.allowed) from exc

    def within(self, limits: Limits, context: int) -> StrategyCall:
        """This call within the server's limits: every width, depth and token parameter (nested
        strategies' too) checked, and the budget it will run under (`Limits.strategy_budget`)."""
        from metaloom.wiring.configure import build_strategy

        def inspect(label: str, values: dict[str, Any]) -> None:
            limits.check_component(label, values, context, self.origin)

        build_strategy(self.name, self.params, self.groups, {"dry": True, "inspect": inspect})
        budget = limits.strategy_budget(self.budget)
        return dataclasses.replace(self, budget=budget)

    def build(self, sampling: SamplingParams, generator: Generator) -> Strategy:
        """The strategy, with the request's own sampling parameters (those it set) applied to it."""
        from metaloom.wiring.configure import build_strategy

        strategy = build_strategy(self.name, self.params, self.groups, {"generator": generator})
        changed = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(SamplingParams)
                   if getattr(sampling, f.name) != getattr(_DEFAULT, f.name)}
        if changed:
            own = getattr(strategy, "params", None)
            if not isinstance(own, SamplingParams):
                raise InvalidParameter(sorted(changed)[0], changed[sorted(changed)[0]],
                                       f"unset: strategy {self.name!r} takes no sampling parameters")
            strategy = dataclasses.replace(strategy, params=dataclasses.replace(own, **changed))
        return strategy

    def report(self, result: Any) -> dict[str, Any]:
        """The strategy's own figures for the response's ``metaloom`` block."""
        out: dict[str, Any] = {"strategy": self.name, "answer": result.answer, "best_index": result.best_index,
                               "stopped_reason": result.stopped_reason,
                               "candidates": [{"text": c.text, "tokens": len(c.token_ids), "finish_reason": c.finish_reason}
                                              for c in result.candidates],
                               "scores": [s if math.isfinite(s) else None for s in result.scores],
                               "answers": list(result.answers)}
        if self.trace:
            out["trace"] = [e.to_dict() for e in result.trace]
        return out


def resolve_model(model: str, served: tuple[str, ...], options: StrategyOptions | None) -> StrategyCall | None:
    """The strategy a request asks for (None: plain generation); 404 for a model not served."""
    if model in served:
        return None if options is None else _from_options(options)
    name, sep, base = model.rpartition(":")
    if not sep or base not in served or not name:
        raise ApiError(404, f"model {model!r} not found; served: {list(served)} (or STRATEGY@param=v,...:{served[0]})",
                       "invalid_request_error", param="model", code="model_not_found")
    if options is not None:
        raise InvalidParameter("metaloom", "set", f"unset when the model alias {model!r} names the strategy")
    from metaloom.wiring.spec import BUDGET, parse_spec

    spec = parse_spec(name, "model")
    params: dict[str, str] = {**spec.params, **{f"{g}.{k}": v for g, ps in spec.groups.items() if g != BUDGET
                                                for k, v in ps.items()}}
    call = _from_options(StrategyOptions(strategy=spec.name, params=params))
    # budget.FIELD=LIMIT in the alias caps each request's run
    return dataclasses.replace(call, budget=spec.budget(), origin="model")


def _from_options(options: StrategyOptions) -> StrategyCall:
    from metaloom.ledger import parse_budget

    params, groups = strategy_params(options)
    items = [f"{k}={int(v) if float(v).is_integer() else v}" for k, v in options.budget.items()]
    budget = parse_budget(items) if items else None
    return StrategyCall(options.strategy, params, groups, budget, options.trace)
