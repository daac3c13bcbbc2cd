"""`metaloom run --strategy NAME [--strategy.PARAM VALUE ...] PROMPT`: run a meta-strategy.

Strategy parameters are the strategy dataclass's fields, converted to their declared types
(`metaloom.wiring.configure`). A field that holds a component (scorer, extractor, utility,
feedback, inner strategy) takes a registry name, and ``--FIELD.PARAM VALUE`` configures that
component (``--strategy.scorer reward_model --scorer.path ./rm``). Sampling flags
(``--temperature``, ``--max-tokens``, ...) override the strategy's own sampling defaults
only when given. ``--budget FIELD=LIMIT`` caps any usage field.

Bad input is one `InvalidParameter` (one ``error:`` line, exit status 2) before any model
loads: the dotted parameters are checked against the strategy's fields and types first, so
a prompt taken as a parameter's value (``--strategy.n "Q"``) is reported as that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from metaloom.commands.common import (
    SAMPLER_DESTS,
    add_model_args,
    add_sampling_args,
    engine_options,
    remote_generator,
    sampling_kwargs,
)
from metaloom.errors import InvalidParameter
from metaloom.ledger import parse_budget
from metaloom.score.protocols import Prompt, Raw
from metaloom.wiring.configure import Plan
from metaloom.wiring.engines import prefix_cache


class Dotted(NamedTuple):
    """One ``--GROUP.PARAM VALUE`` flag; ``detached`` when VALUE was the next argument
    (``--GROUP.PARAM VALUE``, not ``--GROUP.PARAM=VALUE``), so it may have been meant as the prompt."""

    group: str
    param: str
    value: str | None  # None: no value given
    detached: bool = False


def split_dotted(args: Sequence[str]) -> tuple[list[Dotted], list[str]]:
    """Pull ``--GROUP.PARAM VALUE`` / ``--GROUP.PARAM=VALUE`` out of ``args``: returns the
    `Dotted` flags (value None when missing) and the other arguments."""
    dotted: list[Dotted] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        head = a[2:].split("=", 1)[0]
        if a.startswith("--") and "." in head and not head.startswith("."):
            group, _, param = head.partition(".")
            if "=" in a:
                dotted.append(Dotted(group, param, a.split("=", 1)[1]))
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                dotted.append(Dotted(group, param, args[i + 1], detached=True))
                i += 1
            else:
                dotted.append(Dotted(group, param, None))
        else:
            rest.append(a)
        i += 1
    return dotted, rest


class DottedParser(argparse.ArgumentParser):
    """An argument parser that also accepts free-form ``--GROUP.PARAM VALUE`` flags (their
    names depend on the strategy chosen, so they cannot be declared up front)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        dotted, rest = split_dotted(list(sys.argv[1:] if args is None else args))
        ns, extras = super().parse_known_args(rest, namespace)
        ns.dotted = dotted
        return ns, extras


def register(sub: argparse._SubParsersAction) -> None:
    previous = sub._parser_class
    sub._parser_class = DottedParser  # argparse offers no public per-subcommand parser class
    try:
        r = sub.add_parser("run", help="run a meta-generation strategy (see `metaloom strategies`)")
    finally:
        sub._parser_class = previous
    # optional for argparse so that a prompt taken as a parameter's value is reported by
    # `strategy_config` (after the parameters are checked), not as a usage dump
    r.add_argument("prompt", nargs="?", default=None, help="the prompt (required)")
    r.add_argument("--strategy", required=True, help="strategy name (`metaloom strategies` lists them)")
    add_model_args(r, remote=True)
    add_sampling_args(r)
    for action in r._actions:  # only the flags given override the strategy's own sampling defaults
        if action.dest in SAMPLER_DESTS:
            action.default = argparse.SUPPRESS
    r.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    r.add_argument("--system", default=None, help="system message (chat mode)")
    r.add_argument("--budget", action="append", default=[], metavar="FIELD=LIMIT",
                   help="cap a usage field, e.g. output_tokens=2000 (repeatable); the run stops cleanly at it")
    r.add_argument("--json", action="store_true", help="print one JSON object: best, candidates, scores, usage, trace")
    r.add_argument("--progress", action="store_true", help="progress bar on stderr (default: when stderr is a terminal)")
    r.add_argument("--prefix-cache-mb", type=int, default=1024, metavar="MB",
                   help="radix prefix cache kept across the strategy's calls (prompts and generated tokens, so a "
                        "continuation prefills only what is new); 0 turns it off")
    r.set_defaults(run=run)


class RunConfig(NamedTuple):
    """What `strategy_config` read: the strategy's parameters and its components' (as text),
    the sampling overrides, and the `Plan` they make, built once the model is loaded."""

    params: dict[str, str]
    groups: dict[str, dict[str, str]]
    sampling: dict[str, Any]
    plan: Plan


def strategy_config(args: argparse.Namespace) -> RunConfig:
    """The run's configuration, checked before any model loads: the dotted values against the
    strategy's (and its components') fields, types and value checks, the sampling flags, then
    that a prompt was given. Its plan is built once the model is there (`Plan.build`): the text
    is read once, not once to check and again to build."""
    from metaloom.sampling import SamplingParams
    from metaloom.wiring.configure import plan_strategy
    from metaloom.wiring.spec import BUDGET, parse_spec

    dotted: list[Dotted] = getattr(args, "dotted", [])
    # --strategy takes a spec too (NAME@param=v,...: what `metaloom eval --select` prints);
    # a parameter given both ways is an error, not a silent override
    spec = parse_spec(args.strategy, "strategy")
    args.strategy = spec.name
    params: dict[str, str] = dict(spec.params)
    groups: dict[str, dict[str, str]] = {g: dict(p) for g, p in spec.groups.items() if g != BUDGET}
    args.budget = [*getattr(args, "budget", []), *spec.budget_items()]  # a field set both ways: parse_budget refuses
    parse_budget(args.budget)
    for group, key, value, _ in dotted:
        if value is None:
            raise InvalidParameter(f"{group}.{key}", None, f"a value: --{group}.{key} VALUE")
        target = params if group == "strategy" else groups.setdefault(group, {})
        if key in target:
            raise InvalidParameter(f"{group}.{key}", value, f"one value (the spec already sets it to {target[key]!r})")
        target[key] = value
    sampling = sampling_kwargs(args)
    if "n" in sampling:
        raise InvalidParameter("n", sampling["n"], "not a sampling flag here: the strategy's --strategy.n (or batch)")
    SamplingParams(**sampling)  # validate the flags themselves before any model load
    prompt = getattr(args, "prompt", None)
    swallowed = [d for d in dotted if d.detached]
    hint = ""
    if prompt is None and swallowed:
        d = swallowed[-1]
        hint = f" ({d.value!r} was taken as the value of --{d.group}.{d.param}, so the prompt is missing)"
    try:
        plan = plan_strategy(args.strategy, params, groups)  # names, parameters, types, values
    except InvalidParameter as exc:
        if hint:
            raise InvalidParameter(exc.name, exc.value, exc.allowed + hint) from exc
        raise
    if prompt is None:
        raise InvalidParameter("prompt", None, "the text to run the strategy on, as its own argument" + hint)
    return RunConfig(params, groups, sampling, plan)


def run(args: argparse.Namespace) -> int:
    from metaloom.generator import LocalGenerator
    from metaloom.ledger import Ledger
    from metaloom.models import load
    from metaloom.sampling import SamplingParams

    _, _, sampling, plan = strategy_config(args)  # names, parameters, types, prompt: before the load
    budget = parse_budget(args.budget)
    prefix_cache(args.prefix_cache_mb, None)  # validated before the load
    generator: Any = remote_generator(args)
    if generator is not None:
        name = args.model

        def second(model: str) -> Any:  # another model on the same server
            return remote_generator(argparse.Namespace(**{**vars(args), "model": model}))
    else:
        loaded = load(args.model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                      **engine_options(args))
        generator, name = LocalGenerator(loaded, prefix_cache=prefix_cache(args.prefix_cache_mb, loaded)), loaded.name

        def second(model: str) -> Any:  # another model, loaded as the first was
            other = load(model, dtype=args.dtype, device=args.device, backend=args.backend, weights=args.weights,
                         **engine_options(args))
            return LocalGenerator(other, prefix_cache=prefix_cache(args.prefix_cache_mb, other))
    bar = None
    if args.progress or sys.stderr.isatty():
        generator, bar = with_progress(generator)
    strategy = plan.build({"generator": generator, "load_generator": second})
    if sampling:
        if not isinstance(getattr(strategy, "params", None), SamplingParams):
            raise InvalidParameter("sampling flags", sampling, f"none: strategy {args.strategy!r} has no sampling params")
        strategy = dataclasses.replace(strategy, params=dataclasses.replace(strategy.params, **sampling))
    prompt = run_prompt(args)
    ledger = Ledger(budget=budget)
    try:
        result = strategy.run(prompt, generator, ledger=ledger)
    finally:
        if bar is not None:
            bar.close()
    for e in result.trace:  # a search that never saw its delimiter: said where it is seen, not only traced
        if e.kind == "no_delimiter":
            print("warning: " + str(e.data.get("detail", "no step ended with the delimiter"))
                  + f" (delimiter {e.data.get('delimiter')})", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": name, "strategy": args.strategy, **result.to_dict()}))
        return 0
    print(result.best)
    print(f"--- {args.strategy}: answer={result.answer!r} stopped_reason={result.stopped_reason}")
    for i, c in enumerate(result.candidates):
        s = f" score={result.scores[i]:.4g}" if result.scores else ""
        a = f" answer={result.answers[i]!r}" if result.answers else ""
        mark = "*" if i == result.best_index else " "
        print(f"{mark}[{i}]{s}{a} ({len(c.token_ids)} tokens, {c.finish_reason}): {c.text[:200]!r}")
    print("usage: " + json.dumps(result.usage.to_dict()))
    for e in result.trace:
        print("trace: " + json.dumps(e.to_dict(), default=str))
    return 0


def run_prompt(args: argparse.Namespace) -> Prompt:
    """The prompt as the strategy gets it: chat messages (``--system`` first), or with ``--raw``
    the text as it is (`Raw`: a plain str would be read as the user's message)."""
    if args.raw:
        return Raw(args.prompt)
    system = ({"role": "system", "content": args.system},) if args.system else ()
    return (*system, {"role": "user", "content": args.prompt})


class _Progress:
    """A `Generator` wrapper that advances a tqdm bar by the output tokens of each call
    (strategies know nothing of it); other attributes (tokenizer, render) pass through."""

    def __init__(self, inner: Any, bar: Any) -> None:
        self.inner, self.bar = inner, bar

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, requests: Any, *, ledger: Any) -> Any:
        before = ledger.usage.output_tokens
        out = self.inner.generate(requests, ledger=ledger)
        self.bar.update(ledger.usage.output_tokens - before)
        return out

    def stream(self, request: Any, *, ledger: Any) -> Any:
        for chunk in self.inner.stream(request, ledger=ledger):
            self.bar.update(len(chunk.token_ids))
            yield chunk


def with_progress(generator: Any) -> tuple[_Progress, Any]:
    from tqdm import tqdm

    bar = tqdm(unit="tok", desc="generating", file=sys.stderr, dynamic_ncols=True)
    return _Progress(generator, bar), bar
