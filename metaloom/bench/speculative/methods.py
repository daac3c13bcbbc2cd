"""metaloom's rows of `metaloom bench speculative`: plain greedy and one `Method` per requested
drafter (``--drafters``), with or without the speculation cost model (``--cost-model``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.models import LoadedModel
from metaloom.sampling import SamplingParams
from metaloom.speculative import Speculative
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.drafter import Drafter
from metaloom.speculative.planned import PlannedDrafter
from metaloom.speculative.registry import AUTO, DRAFTERS, DrafterOptions, auto_candidates, build_drafter, default_num_draft


@dataclass
class Method:
    """One row of the table: ``run(prompt index)`` -> (tokens, ledger or None). ``planned``: the
    cost model of a metaloom method that has one (its choices go into the report)."""

    name: str
    run: Callable[[int], tuple[list[int], Ledger | None]]
    peer: bool = False
    times: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    ledgers: dict[int, Ledger] = field(default_factory=dict)
    planned: PlannedDrafter | None = None
    choices: dict[int, dict[str, Any]] = field(default_factory=dict)

    def only(self, prompts: set[int]) -> Method:
        """This method's measurements of ``prompts`` alone (a report over the prompts that every
        method has run so far)."""
        def keep(d: dict[int, Any]) -> dict[int, Any]:
            return {i: v for i, v in d.items() if i in prompts}

        return replace(self, times=keep(self.times), tokens=keep(self.tokens), ledgers=keep(self.ledgers),
                       choices=keep(self.choices))


def metaloom_method(loaded: LoadedModel, name: str, speculative: Speculative | None, n: int,
                    prompts: tuple[str, ...]) -> Method:
    """metaloom's greedy decoding of ``prompts`` (up to ``n`` tokens), with ``speculative`` (None:
    plain greedy); a cost model's choices are kept per prompt."""
    gen = LocalGenerator(loaded, speculative=speculative)
    planned = speculative.drafter if speculative is not None and isinstance(speculative.drafter, PlannedDrafter) else None

    def run(i: int) -> tuple[list[int], Ledger]:
        ledger = Ledger()
        if planned is not None:  # every call learns from nothing, as a first request (or the CLI) does
            planned.reset()
        out = gen.generate([Request.chat(prompts[i], SamplingParams(temperature=0, max_tokens=n))], ledger=ledger)
        if planned is not None:
            method.choices[i] = planned.report()
        return list(out[0][0].token_ids), ledger

    method = Method(name, run, planned=planned)
    return method


def drafter_methods(args: argparse.Namespace, loaded: LoadedModel, n: int, skipped: dict[str, str]) -> list[Method]:
    """One method per requested drafter, with the cost model (``--cost-model on``, the default),
    without (``off``, K tokens every step) or both; variants: quantized-int4 (4-bit self-draft),
    jacobi-lookup (Jacobi topped up by prompt lookup), auto (the cost model picks the drafter),
    and for the tree drafters NAME/W1.W2... (a static tree of those widths), NAME/chain (a chain
    of K as a tree) and NAME/dynamicN (DySpec's N-node tree); any entry may end in @K, its own
    draft tokens (tree nodes) a step. Unavailable ones land in ``skipped``. The cost model's
    verify cost is measured once for them all."""
    built: list[tuple[str, list[tuple[Drafter, int]]]] = []
    for entry in [d for d in args.drafters.split(",") if d]:
        got = _build_entry(args, loaded, entry, skipped)
        if got is not None:
            built.append(got)
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.cost_model]
    cost = None
    if built and (True in modes or any(label == AUTO for label, _ in built)):
        cost = measure_verify_cost(loaded.model, most=1 + max(k for _, c in built for _, k in c))
    out = []
    prompts = PROMPT_SETS[args.prompts]
    for label, candidates in built:
        k = max(k for _, k in candidates)
        for planned in (True,) if label == AUTO else modes:
            if planned:
                spec = Speculative(PlannedDrafter(candidates, cost=cost, name=candidates[0][0].name if label != AUTO
                                                  else AUTO), k)
                name = f"metaloom {label} (K<={k}, cost model)"
            else:
                spec = Speculative(candidates[0][0], k)
                name = f"metaloom {label} (K={k})"
            out.append(metaloom_method(loaded, name, spec, n, prompts))
    return out


def _build_entry(args: argparse.Namespace, loaded: LoadedModel, entry: str,
                 skipped: dict[str, str]) -> tuple[str, list[tuple[Drafter, int]]] | None:
    """(label, [(drafter, K)]) for one ``--drafters`` entry (auto: every candidate), or None
    with the reason in ``skipped``."""
    variants: dict[str, tuple[str, dict[str, Any]]] = {"quantized-int4": ("quantized", {"bits": 4}),
                                                       "jacobi-lookup": ("jacobi", {"jacobi_fill": "lookup"})}
    label, _, own_k = entry.partition("@")  # NAME@K: this drafter's own K (tree nodes for a tree)
    if own_k and not (own_k.isdigit() and 1 <= int(own_k) <= 64):
        skipped[entry] = "the K after @ must be a whole number in [1, 64]"
        return None
    if label == AUTO:
        candidates = auto_candidates(loaded, DrafterOptions(draft_model=args.draft_model))
        return label, [(d, min(k, int(own_k))) if own_k else (d, k) for d, k in candidates]
    base, extra = variants.get(label, (label, dict[str, Any]()))
    if "/" in label:  # a tree drafter with a shape: NAME/W1.W2..., NAME/chain, NAME/dynamicN
        name, shape = label.split("/", 1)
        base, extra = variants.get(name, (name, dict[str, Any]()))
        depth = int(own_k) if own_k else args.num_draft or DRAFTERS.get(base, DRAFTERS["recycling"]).num_draft
        tree = (f"dynamic:{shape.removeprefix('dynamic')}" if shape.startswith("dynamic")
                else "static:" + ",".join(["1"] * depth if shape == "chain" else shape.split(".")))
        extra = {**extra, "tree": tree}
    if base not in DRAFTERS:
        skipped[label] = f"unknown drafter (known: {sorted(DRAFTERS)} and {AUTO})"
        return None
    if base == "draft" and not args.draft_model:
        skipped[label] = "no --draft-model given (the default model has no smaller sibling with its tokenizer)"
        return None
    try:
        drafter = build_drafter(base, loaded, DrafterOptions(draft_model=args.draft_model, **extra))
    except Exception as exc:  # a drafter this model or build cannot have: report, keep benchmarking
        skipped[label] = f"{type(exc).__name__}: {exc}"
        return None
    k = int(own_k) if own_k else args.num_draft or default_num_draft(base, extra.get("tree"))
    return label, [(drafter, k)]
