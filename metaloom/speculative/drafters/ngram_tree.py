"""Prompt lookup as a token tree (``--speculative ngram --tree static:W1,W2,...|dynamic:NODES``).

The chain drafter (`metaloom.speculative.drafters.ngram`) copies what followed one earlier
occurrence of the context's suffix. A context often holds several: a variable used in three
places, a phrase that ends two ways. A tree can propose all of them at once and let the target
keep whichever it agrees with (the n-gram half of REST's and Lookahead decoding's retrieval
trees: He et al. 2024, "REST: Retrieval-Based Speculative Decoding", which merges retrieved
continuations into a trie and keeps its most frequent prefixes; Fu et al. 2024, "Break the
Sequential Dependency of LLM Inference Using Lookahead Decoding", its n-gram pool).

For the longest suffix of ``max_ngram`` .. ``min_ngram`` tokens that occurred before, every
earlier occurrence contributes the tokens that followed it. These continuations are merged into
a trie (continuations that share a prefix share that branch), each trie node counting the
occurrences that pass through it and remembering the latest of them. The trie is cut to the
shape: ``static`` keeps, under each node at depth d, its ``widths[d]`` best children; ``dynamic``
keeps the NODES best nodes overall (best-first from the root, so the kept nodes form a tree).
"Best" is the most occurrences, the most recent first on ties: a count is an estimate of how
often the context goes on that way, recency of where the text is now.

Costs no model call. Drafts are deterministic, so verification is exact for greedy and for
sampling (`metaloom.speculative.tree`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from metaloom.errors import InvalidParameter
from metaloom.models.forward import Ledgers
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import MAX_DRAFT, Draft, DraftState, Verified
from metaloom.speculative.drafters.ngram import NgramIndex
from metaloom.speculative.tree import DraftTree, TreeShape

# the most recent occurrences read per step: a 1-gram like " the" can occur thousands of times
# in a long context, and the host work of a step must stay bounded; the ranking is then over
# the most recent ones
MAX_OCCURRENCES = 256


@dataclass
class TrieNode:
    """A trie node: ``count`` occurrences continue through it, the latest ending at ``last``
    (the position in the context where that occurrence's continuation starts)."""

    token: int
    count: int = 0
    last: int = -1
    children: dict[int, TrieNode] = field(default_factory=dict)

    def ranked(self) -> list[TrieNode]:
        """The children, best first: most occurrences, then most recent. Two siblings never tie
        (their occurrences are disjoint, so their latest ones differ)."""
        return sorted(self.children.values(), key=lambda n: (-n.count, -n.last))


def occurrences(context: Sequence[int], ends: Sequence[int], depth: int) -> list[tuple[int, tuple[int, ...]]]:
    """(end, the up to ``depth`` tokens after it) for each occurrence ending at ``ends[i]``."""
    return [(e, tuple(context[e:e + depth])) for e in ends]


def build_trie(continuations: Sequence[tuple[int, Sequence[int]]]) -> TrieNode:
    """Merge (end, tokens) continuations into a trie under a root (token -1); shared prefixes
    become one branch whose count is the number of continuations through it."""
    root = TrieNode(-1)
    for end, tokens in continuations:
        node = root
        for token in tokens:
            node = node.children.setdefault(int(token), TrieNode(int(token)))
            node.count += 1
            node.last = max(node.last, end)
    return root


def cut_static(root: TrieNode, widths: Sequence[int], budget: int) -> DraftTree:
    """Breadth-first: under each node at depth d (0: the root) its ``widths[d]`` best children,
    at most ``budget`` nodes (a breadth-first prefix, so shallow nodes are kept first)."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier: list[tuple[int, TrieNode]] = [(-1, root)]
    for width in widths:
        nxt = []
        for index, node in frontier:
            for child in node.ranked()[:width]:
                if len(tokens) >= budget:
                    return DraftTree(tuple(tokens), tuple(parents))
                tokens.append(child.token)
                parents.append(index)
                nxt.append((len(tokens) - 1, child))
        frontier = nxt
    return DraftTree(tuple(tokens), tuple(parents))


def cut_dynamic(root: TrieNode, budget: int) -> DraftTree:
    """The ``budget`` best nodes, grown best-first from the root: a child never has more
    occurrences (nor a later one) than its parent, so this keeps the globally best nodes and
    they form a tree. Ties (equal count and latest occurrence: a parent and its only
    continuation) go to the shallower node, then to the one found first."""
    tokens: list[int] = []
    parents: list[int] = []
    order = 0
    heap: list[tuple[int, int, int, int, int, TrieNode]] = []  # (-count, -last, depth, order, parent, node)

    def offer(parent: int, depth: int, node: TrieNode) -> None:
        nonlocal order
        for child in node.children.values():
            heapq.heappush(heap, (-child.count, -child.last, depth, order, parent, child))
            order += 1

    offer(-1, 1, root)
    while heap and len(tokens) < budget:
        _, _, depth, _, parent, node = heapq.heappop(heap)
        tokens.append(node.token)
        parents.append(parent)
        offer(len(tokens) - 1, depth + 1, node)
    return DraftTree(tuple(tokens), tuple(parents))


@dataclass(frozen=True)
class NgramTreeDrafter:
    """Every earlier occurrence of the longest matching suffix (``max_ngram`` .. ``min_ngram``
    tokens), their continuations merged into a trie and cut to ``shape``."""

    shape: TreeShape
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidParameter("min_ngram/max_ngram", (self.min_ngram, self.max_ngram), "1 <= min_ngram <= max_ngram")
        self.shape.check_fits(MAX_DRAFT, "ngram")

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> NgramTreeState:
        return NgramTreeState(self, [NgramIndex() for _ in contexts])

    def tree(self, context: Sequence[int], ends: Sequence[int], budget: int) -> DraftTree:
        """The tree from the occurrences ending at ``ends`` (continuations start there)."""
        depth = len(self.shape.widths) if self.shape.nodes is None else min(budget, self.shape.nodes)
        root = build_trie(occurrences(context, ends[-MAX_OCCURRENCES:], depth))
        if self.shape.nodes is None:
            return cut_static(root, self.shape.widths, budget)
        return cut_dynamic(root, min(budget, self.shape.nodes))


class NgramTreeState:
    def __init__(self, drafter: NgramTreeDrafter, rows: list[NgramIndex]) -> None:
        self.drafter = drafter
        self.rows = rows
        self.sizes = range(drafter.min_ngram, drafter.max_ngram + 1)

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        trees = []
        for index, context, limit in zip(self.rows, contexts, limits, strict=True):
            index.update(context, self.sizes)
            ends = index.ends(context, self.sizes) if limit > 0 else []
            trees.append(self.drafter.tree(context, ends, limit) if ends else DraftTree((), ()))
        return Draft.from_trees(trees)

    def observe(self, verified: Verified) -> None:
        pass

    def select(self, rows: Sequence[int]) -> NgramTreeState:
        return NgramTreeState(self.drafter, [self.rows[r] for r in rows])

    def join(self, other: DraftState) -> NgramTreeState:
        assert isinstance(other, NgramTreeState)
        return NgramTreeState(self.drafter, self.rows + other.rows)
