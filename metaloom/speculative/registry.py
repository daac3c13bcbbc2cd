"""Drafters by name, for the edges (CLI, server, benchmark): name -> factory.

A factory takes the loaded target and `DrafterOptions` and returns a `Drafter`; each drafter
reads the options it needs. ``DRAFTERS[name].num_draft`` is its default K.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.models.load import LoadedModel
from metaloom.speculative.drafter import Drafter


@dataclass(frozen=True)
class DrafterOptions:
    """Every drafter's options, as the CLI collects them."""

    draft_model: str | None = None  # path of the draft model ("draft")
    draft_dtype: str | None = None  # dtype of the draft model; None: the target's
    bits: int = 8  # weight bits of the quantised self-draft ("quantized"): 8 or 4
    max_ngram: int = 3  # prompt lookup ("ngram")
    jacobi_fill: str = "repeat"  # how Jacobi tops up its guess block: "repeat" | "lookup"
    heads_path: str | None = None  # speculator heads file ("heads"); None: the heads shipped for the target
    # a token tree's shape (`TREE_DRAFTERS`): static:W1,W2,... or dynamic:N; None: a chain (recycling: its default tree)
    tree: str | None = None


@dataclass(frozen=True)
class DrafterEntry:
    build: Callable[[LoadedModel, DrafterOptions], Drafter]
    num_draft: int  # default K: draft tokens per step


def _ngram(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.speculative.drafters.ngram import NgramDrafter

    if o.tree is not None:
        from metaloom.speculative.drafters.ngram_tree import NgramTreeDrafter
        from metaloom.speculative.tree import TreeShape

        return NgramTreeDrafter(TreeShape.parse(o.tree), max_ngram=o.max_ngram)
    return NgramDrafter(max_ngram=o.max_ngram)


def _draft(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.models import load
    from metaloom.speculative.drafters.draft_model import DraftModelDrafter

    if o.draft_model is None:
        raise InvalidParameter("draft_model", None, "a path to a draft model with the target's tokenizer (--draft-model)")
    dtype = o.draft_dtype or str(target.dtype).removeprefix("torch.")
    draft = load(o.draft_model, dtype=dtype, device=str(target.model.device))
    if draft.tokenizer.encode("def hello(world):") != target.tokenizer.encode("def hello(world):"):
        raise InvalidParameter("draft_model", o.draft_model, "a model with the target's tokenizer")
    if o.tree is not None:
        return _tree(draft.model, o.tree, "draft")
    return DraftModelDrafter(draft.model)


def _tree(model: object, tree: str, name: str) -> Drafter:
    from metaloom.speculative.drafters.draft_tree import draft_tree_drafter
    from metaloom.speculative.tree import TreeShape

    return draft_tree_drafter(model, TreeShape.parse(tree), name)  # type: ignore[arg-type]


def _quantized(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.speculative.drafters.quantized import QuantizedLlama, quantized_drafter

    if o.tree is not None:
        return _tree(QuantizedLlama(target.model, o.bits), o.tree, f"quantized-int{o.bits}")
    return quantized_drafter(target.model, o.bits)


def _jacobi(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.speculative.drafters.jacobi import JacobiDrafter

    return JacobiDrafter(fill=o.jacobi_fill)


def _recycling(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.speculative.drafters.recycling import RecyclingDrafter
    from metaloom.speculative.tree import TreeShape

    return RecyclingDrafter(None if o.tree is None else TreeShape.parse(o.tree))


def _heads(target: LoadedModel, o: DrafterOptions) -> Drafter:
    from metaloom.speculative.drafters.heads import HeadsDrafter

    if o.tree is not None:
        from metaloom.speculative.drafters.heads_tree import HeadsTreeDrafter
        from metaloom.speculative.tree import TreeShape

        return HeadsTreeDrafter(TreeShape.parse(o.tree), path=o.heads_path)
    return HeadsDrafter(path=o.heads_path)


DRAFTERS: dict[str, DrafterEntry] = {
    "ngram": DrafterEntry(_ngram, num_draft=10),
    "draft": DrafterEntry(_draft, num_draft=4),
    "quantized": DrafterEntry(_quantized, num_draft=4),
    "heads": DrafterEntry(_heads, num_draft=3),
    "jacobi": DrafterEntry(_jacobi, num_draft=4),
    "recycling": DrafterEntry(_recycling, num_draft=16),  # tree nodes a step
}
TREE_DRAFTERS = ("recycling", "draft", "quantized", "ngram", "heads")  # the drafters that take --tree


def default_num_draft(name: str, tree: str | None = None) -> int:
    """Draft tokens a step when none are asked for: the drafter's own, or with ``--tree`` the
    whole tree (capped at `MAX_DRAFT`): a tree cut to a chain drafter's K would be mostly lost
    (``--speculative heads --tree static:4,2`` would verify 3 of its 12 nodes)."""
    from metaloom.speculative.drafter import MAX_DRAFT
    from metaloom.speculative.tree import TreeShape

    own = DRAFTERS[name].num_draft
    return own if tree is None else min(MAX_DRAFT, TreeShape.parse(tree).size)


def build_drafter(name: str, target: LoadedModel, options: DrafterOptions) -> Drafter:
    entry = DRAFTERS.get(name)
    if entry is None:
        raise InvalidParameter("speculative", name, f"one of {sorted(DRAFTERS)} or {AUTO!r}")
    if options.tree is not None and name not in TREE_DRAFTERS:
        raise InvalidParameter("tree", options.tree, f"given with a tree drafter ({', '.join(TREE_DRAFTERS)})")
    return entry.build(target, options)


AUTO = "auto"  # --speculative auto: the cost model picks the drafter too


def auto_candidates(target: LoadedModel, options: DrafterOptions) -> list[tuple[Drafter, int]]:
    """The drafters ``--speculative auto`` chooses among, each with its default K: prompt lookup
    and Token Recycling (its tree) always; speculator heads when heads for the target exist
    (shipped, or ``heads_path``); the draft model when ``draft_model`` is given; the quantised
    self-draft on dense weights (it requantises dense weights). Jacobi is left out: on the
    prompts measured it never beat prompt lookup, whose copies it uses when it does well."""
    from metaloom.errors import MetaloomError
    from metaloom.speculative.drafters.heads import heads_for

    names = ["ngram", "recycling"]
    try:
        heads_for(target.model, options.heads_path)
        names.append("heads")
    except MetaloomError:
        pass
    if options.draft_model is not None:
        names.append("draft")
    if target.weights == "dense" and target.model.device.type == "cpu":
        names.append("quantized")
    return [(build_drafter(n, target, options), DRAFTERS[n].num_draft) for n in names]
