"""Token trees for speculative decoding: a row's drafts as a tree verified in one forward, and
which path of it the target keeps.

A `DraftTree` holds nodes in topological order: node ``i`` proposes ``tokens[i]`` after its
parent (``parents[i]``, an earlier node, or -1 for the row's pending token, the root). The
verify forward feeds ``[pending, tokens...]`` at positions ``start + depth`` with a tree
attention mask (each node sees the cache, the root and its own ancestors: `attention_mask`),
which gives the target distribution after the root (``p_0``) and after every node (``p_{i+1}``).

Acceptance walks from the root. At a node whose children propose tokens ``c_1 .. c_k``
(distinct, each a deterministic proposal), the target's own token ``x`` at that node is what
plain decoding would emit there: ``argmax p`` for greedy rows, for sampled rows plain sampling's
draw (the inverse CDF of ``p`` at the row's uniform for that position, `metaloom.sampling.counter`;
see `metaloom.speculative.core`). The walk moves into the child whose token is ``x``, if there is
one, and repeats; otherwise it stops and emits ``x``. The emitted tokens are plain decoding's,
greedy or sampled, whatever the tree. A node's children are accepted with probability
``sum_j p(c_j)``, the most any rule can give deterministic candidates, and what SpecInfer's
multi-step speculative sampling gives them (Miao et al. 2024, Algorithm 2, with q one-hot; the
same as Recursive Speculative Decoding's sampling without replacement, Jeon et al. 2024): every
tree drafter here (the draft model's top-k, DySpec's best-first expansion, Token Recycling,
n-gram continuations, speculator heads' top-k) proposes tokens without sampling them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.kernels import draw as c_draw
from metaloom.sampling.counter import inverse_cdf, uniforms


@dataclass(frozen=True)
class TreeShape:
    """``--tree``: ``static:W1,W2,...`` (``widths``: children per node at each depth, W1 under the
    root; all 1 is a chain) or ``dynamic:NODES`` (``nodes``: DySpec's best-first growth by draft
    probability up to that many nodes; drafters with probabilities only)."""

    widths: tuple[int, ...] = ()
    nodes: int | None = None

    def __post_init__(self) -> None:
        if self.nodes is None and (not self.widths or any(not isinstance(w, int) or w < 1 for w in self.widths)):
            raise InvalidParameter("tree", list(self.widths), "widths >= 1 per depth (static:W1,W2,...)")
        if self.nodes is not None and (self.widths or not isinstance(self.nodes, int) or self.nodes < 1):
            raise InvalidParameter("tree", self.nodes, "dynamic:NODES with NODES >= 1")

    @property
    def size(self) -> int:
        """The tree's nodes when drafted whole: a static tree's W1 + W1 W2 + ..., or NODES."""
        if self.nodes is not None:
            return self.nodes
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    def check_fits(self, most: int, drafter: str) -> None:
        """Refuse a shape wider than ``most`` (a level of a static tree, or a dynamic tree's
        nodes): the decode loop verifies at most ``num_draft`` <= `MAX_DRAFT` nodes a step
        (`metaloom.speculative.drafter`), so such a tree could never be drafted whole, and asking
        for one is a mistake worth naming rather than a tree silently cut."""
        if self.nodes is None and max(self.widths) > most:
            raise InvalidParameter("tree", list(self.widths), f"widths at most {most} for {drafter}")
        if self.nodes is not None and self.nodes > most:
            raise InvalidParameter("tree", f"dynamic:{self.nodes}", f"dynamic:NODES with NODES at most {most} for {drafter}")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        kind, _, rest = text.partition(":")
        if kind not in ("static", "dynamic"):
            raise InvalidParameter("tree", text, "static:W1,W2,... (widths per depth) or dynamic:NODES")
        try:
            numbers = [int(w) for w in rest.split(",")]
        except ValueError:
            numbers = []
        if not numbers or min(numbers) < 1 or (kind == "dynamic" and len(numbers) != 1):
            # 0 is a whole number too: say what is allowed, >= 1
            raise InvalidParameter("tree", text, "static:W1,W2,... or dynamic:NODES with whole numbers >= 1")
        return cls(tuple(numbers)) if kind == "static" else cls(nodes=numbers[0])


@dataclass(frozen=True)
class DraftTree:
    """One row's draft: ``tokens[i]`` after ``parents[i]`` (-1: the pending token; else an
    earlier node). Siblings propose distinct tokens."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise InvalidParameter("parents", len(self.parents), f"one per token ({len(self.tokens)})")
        seen: set[tuple[int, int]] = set()
        for i, (t, p) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if not -1 <= p < i:
                raise InvalidParameter("parents", list(self.parents), "each -1 or an earlier node (topological order)")
            if (p, t) in seen:
                raise InvalidParameter("tokens", list(self.tokens), f"distinct tokens among siblings (token {t} twice)")
            seen.add((p, t))

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A chain: each token after the one before (the drafts of today's drafters)."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: the root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for the root, -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def attention_mask(tree: DraftTree) -> torch.Tensor:
    """[1 + n, 1 + n] bool: row i of the verify block (0: the pending token, i: node i - 1)
    may attend column j (True) when j is i or one of its ancestors (the root is everyone's)."""
    n = len(tree)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(tree.parents):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


@dataclass(frozen=True)
class TreeAcceptance:
    """The path kept (node indices from the root's child down) and the tokens emitted: the
    path's tokens, then the target's own token after it."""

    path: tuple[int, ...]
    tokens: tuple[int, ...]


def accept_walk(tree: DraftTree, own: Sequence[int]) -> TreeAcceptance:
    """``own[i]``: the target's own token after block position i (0: the root), argmax or plain
    sampling's draw there: follow the children that propose it (see the module doc)."""
    node, path = -1, list[int]()
    while True:
        want = int(own[node + 1])
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return TreeAcceptance(tuple(path), tuple([tree.tokens[i] for i in path] + [want]))
        path.append(nxt)
        node = nxt


def accept_greedy(tree: DraftTree, argmax: Sequence[int]) -> TreeAcceptance:
    """``argmax[i]``: the target's greedy token after block position i (0: the root)."""
    return accept_walk(tree, argmax)


def block_depths(tree: DraftTree) -> list[int]:
    """The depth of each block position (0: the root, then each node's), i.e. how far past the
    row's next position the token drawn there goes."""
    return [0, *tree.depths()]


def accept_sampled(tree: DraftTree, probs: torch.Tensor, key: int, position: int) -> TreeAcceptance:
    """One row's sampled acceptance: ``probs`` [1 + n, V], the target distribution after each
    block position (the sampling pipeline's, penalties and truncation applied); ``key`` and
    ``position`` (of the row's next token) give plain sampling's uniforms. The decode loop runs
    the same batched (`metaloom.decode.tree_verify.verify_tree`)."""
    at = np.asarray(block_depths(tree), dtype=np.int64) + position
    u = torch.from_numpy(uniforms(np.full(len(at), key, dtype=np.int64), at))
    return accept_walk(tree, inverse_cdf(probs.double().clamp(min=0).log(), u, c_draw.search).tolist())
