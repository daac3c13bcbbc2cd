"""Speculative-decoding flags shared by subcommands: ``--speculative NAME [--draft-model PATH]
[--num-draft K] [--tree static:W1,W2,...]``; drafters come from `metaloom.speculative.registry.DRAFTERS`."""

from __future__ import annotations

import argparse

from metaloom.errors import InvalidParameter
from metaloom.ledger import Usage
from metaloom.models.load import LoadedModel
from metaloom.speculative import MAX_DRAFT, Speculative
from metaloom.speculative.registry import DRAFTERS, TREE_DRAFTERS, DrafterOptions, build_drafter, default_num_draft


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, choices=sorted(DRAFTERS),
                   help="draft-and-verify decoding (same output greedy, same distribution sampling): "
                        "ngram = prompt lookup, draft = --draft-model, "
                        "quantized = the model requantised to Q8_0 (Q4_1 with --quant-bits 4), "
                        "heads = speculator heads, jacobi = Jacobi iteration, "
                        "recycling = Token Recycling (the model's own past candidates, as a token tree); "
                        "ngram, heads, draft, quantized and recycling take --tree")
    p.add_argument("--draft-model", default=None, help="draft model for --speculative draft (same tokenizer)")
    p.add_argument("--num-draft", type=int, default=None,
                   help=f"draft tokens per step, 1..{MAX_DRAFT} (default: the drafter's own)")
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
    if getattr(args, "tree", None) is not None:
        from metaloom.speculative.tree import TreeShape

        if args.speculative not in TREE_DRAFTERS:
            raise InvalidParameter("tree", args.tree, f"given with a tree drafter ({', '.join(TREE_DRAFTERS)})")
        if TreeShape.parse(args.tree).nodes is not None and args.speculative == "recycling":
            raise InvalidParameter("tree", args.tree, "static:W1,W2,... for recycling (a dynamic tree grows by draft "
                                                      "probabilities)")
    if args.speculative == "draft" and args.draft_model is None:
        raise InvalidParameter("draft_model", None, "a model path with --speculative draft")
    if args.num_draft is not None and not 1 <= args.num_draft <= MAX_DRAFT:
        raise InvalidParameter("num_draft", args.num_draft, f"an integer in [1, {MAX_DRAFT}]")


def speculative_option(args: argparse.Namespace, loaded: LoadedModel) -> Speculative | None:
    if args.speculative is None:
        return None
    options = DrafterOptions(draft_model=args.draft_model, bits=args.quant_bits, tree=getattr(args, "tree", None))
    drafter = build_drafter(args.speculative, loaded, options)
    k = args.num_draft if args.num_draft is not None else default_num_draft(args.speculative, options.tree)
    return Speculative(drafter, k)


def speculative_report(speculative: Speculative | None, usage: Usage) -> dict:
    """The ``speculative`` object of a JSON report (empty without speculation)."""
    if speculative is None:
        return {}
    return {"speculative": {"drafter": speculative.drafter.name, "num_draft": speculative.num_draft,
                            "drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens,
                            "rejected_tokens": usage.rejected_tokens, "verify_steps": usage.verify_steps,
                            "acceptance_rate": usage.acceptance_rate, "accepted_per_step": usage.accepted_per_step}}
