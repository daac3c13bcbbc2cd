"""Speculative-decoding flags shared by subcommands: ``--speculative NAME|auto [--draft-model PATH]
[--num-draft K] [--tree static:W1,W2,...] [--cost-model on|off]``; drafters come from
`metaloom.speculative.registry.DRAFTERS`, the cost model from `metaloom.speculative.planned`."""

from __future__ import annotations

import argparse

from metaloom.errors import InvalidParameter
from metaloom.ledger import Usage
from metaloom.models.load import LoadedModel
from metaloom.speculative import MAX_DRAFT, Speculative
from metaloom.speculative.planned import PlannedDrafter
from metaloom.speculative.registry import (
    AUTO,
    DRAFTERS,
    TREE_DRAFTERS,
    DrafterOptions,
    auto_candidates,
    build_drafter,
    default_num_draft,
)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, choices=[*sorted(DRAFTERS), AUTO],
                   help="draft-and-verify decoding (same output greedy, same distribution sampling): "
                        "auto = the cost model picks the drafter each step (ngram, recycling, heads where the model "
                        "has them, draft with --draft-model, quantized on dense weights) or none, "
                        "ngram = prompt lookup, draft = --draft-model, "
                        "quantized = the model requantised to Q8_0 (Q4_1 with --quant-bits 4), "
                        "heads = speculator heads, jacobi = Jacobi iteration, "
                        "recycling = Token Recycling (the model's own past candidates, as a token tree); "
                        "ngram, heads, draft, quantized and recycling take --tree")
    p.add_argument("--draft-model", default=None, help="draft model for --speculative draft (same tokenizer)")
    p.add_argument("--num-draft", type=int, default=None,
                   help=f"draft tokens per step, 1..{MAX_DRAFT} (default: the drafter's own); with the cost model the "
                        "most a step drafts")
    p.add_argument("--cost-model", choices=("on", "off"), default="on",
                   help="on (default): measure what a verify of k tokens costs against a one-token step on this "
                        "machine, learn each drafter's acceptance while decoding, and draft (and verify) each step "
                        "only as many tokens as maximise the expected tokens per second, none when nothing pays; "
                        "off: always --num-draft")
    p.add_argument("--quant-bits", type=int, default=8, choices=(8, 4), help="weight bits for --speculative quantized")
    p.add_argument("--tree", default=None,
                   help="draft a token tree: static:W1,W2,... = W1 children under the pending token, W2 under each of "
                        "those, ...; dynamic:NODES = the NODES best nodes (draft, quantized: DySpec's best-first growth "
                        "by draft probability; ngram: the most frequent continuations; heads: the highest products "
                        "of head probabilities); --num-draft bounds the nodes (default: the whole tree); "
                        "with --speculative recycling, draft, quantized, ngram or heads")


def check_speculative_args(args: argparse.Namespace) -> None:
    """Validate before any model is loaded."""
    if args.speculative is None:
        if args.draft_model is not None or args.num_draft is not None or getattr(args, "tree", None) is not None:
            raise InvalidParameter("speculative", None, "a drafter name when --draft-model, --num-draft or --tree is given")
        return
    if args.speculative == AUTO:
        if getattr(args, "cost_model", "on") != "on":
            raise InvalidParameter("cost_model", args.cost_model, "'on' with --speculative auto (the cost model "
                                                                  "is what picks the drafter)")
        if getattr(args, "tree", None) is not None:
            raise InvalidParameter("tree", args.tree, "a named drafter (--speculative auto uses each drafter's own "
                                                      "shape: recycling its tree, the others chains)")
        if args.num_draft is not None and not 1 <= args.num_draft <= MAX_DRAFT:
            raise InvalidParameter("num_draft", args.num_draft, f"an integer in [1, {MAX_DRAFT}]")
        return
    if getattr(args, "tree", None) is not None:
        from metaloom.speculative.tree import TreeShape

        if args.speculative not in TREE_DRAFTERS:
            raise InvalidParameter("tree", args.tree, f"given with a tree drafter ({', '.join(TREE_DRAFTERS)})")
        if TreeShape.parse(args.tree).nodes is not None and args.speculative == "recycling":
            raise InvalidParameter("tree", args.tree, "static:W1,W2,... for recycling (a dynamic tree grows by draft "
                                                      "probabilities)")
    if args.speculative == "draft" and args.draft_model is None:
        raise InvalidParameter("draft_model", None, "a model path with --speculative draft")
    if args.speculative == "quantized":  # the self-draft requantises dense weights
        if getattr(args, "weights", "auto") == "native":
            raise InvalidParameter("weights", "native", "dense or auto with --speculative quantized (it requantises "
                                                        "the model's dense weights)")
        args.weights = "dense"  # --weights auto asks for whatever decodes fastest: here, what the self-draft needs
    if args.num_draft is not None and not 1 <= args.num_draft <= MAX_DRAFT:
        raise InvalidParameter("num_draft", args.num_draft, f"an integer in [1, {MAX_DRAFT}]")


def speculative_option(args: argparse.Namespace, loaded: LoadedModel) -> Speculative | None:
    if args.speculative is None:
        return None
    options = DrafterOptions(draft_model=args.draft_model, bits=args.quant_bits, tree=getattr(args, "tree", None))
    if args.speculative == AUTO:
        candidates = auto_candidates(loaded, options)
        if args.num_draft is not None:
            candidates = [(d, min(k, args.num_draft)) for d, k in candidates]
        planned = PlannedDrafter(candidates)
        return Speculative(planned, planned.num_draft)
    drafter = build_drafter(args.speculative, loaded, options)
    k = args.num_draft if args.num_draft is not None else default_num_draft(args.speculative, options.tree)
    if getattr(args, "cost_model", "on") == "on":
        return Speculative(PlannedDrafter([(drafter, k)]), k)
    return Speculative(drafter, k)


def speculative_report(speculative: Speculative | None, usage: Usage) -> dict:
    """The ``speculative`` object of a JSON report (empty without speculation); with the cost
    model, its ``cost_model`` says what it measured and chose (`PlannedDrafter.report`)."""
    if speculative is None:
        return {}
    out = {"drafter": speculative.drafter.name, "num_draft": speculative.num_draft,
           "drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens,
           "rejected_tokens": usage.rejected_tokens, "verify_steps": usage.verify_steps,
           "acceptance_rate": usage.acceptance_rate, "accepted_per_step": usage.accepted_per_step}
    if isinstance(speculative.drafter, PlannedDrafter):
        out["cost_model"] = speculative.drafter.report()
    return {"speculative": out}
