"""Speculator heads drafting a token tree (``--speculative heads --tree static:W1,W2,...|dynamic:NODES``).

Medusa's trees (Cai et al. 2024, "Medusa: simple LLM inference acceleration framework with
multiple decoding heads"): head i proposes its top-k tokens for the token i steps ahead, and the
tree is the Cartesian product of the heads' candidates, cut to a shape:

- ``static:W1,W2,...`` — head i's top-``W_i`` tokens under every node at depth i - 1 (W1 under
  the pending token): the full product, breadth first, cut at the step's node budget.
- ``dynamic:NODES`` — the NODES nodes whose paths have the highest product of head
  probabilities. Medusa picks its sparse tree from the heads' measured top-k accuracies, a
  product along each path, the same way; here the estimate is the heads' own probabilities of
  this step, so the tree follows the heads' confidence (EAGLE-2, Li et al. 2024, does the same
  with its draft's confidence). A path's product never exceeds its parent's, so growing
  best-first from the root keeps exactly the NODES best nodes, and they form a tree.

Every node at depth i gets head i's candidates whatever its parent is: Medusa's heads read only
the target's last verified hidden state, so that is what Medusa does. Our heads are
hierarchical (`metaloom.speculative.heads.model`: stage i also reads stage i - 1's token), and a
stage's distribution depends on which token it was fed; the stages here run once, along the
heads' own greedy chain (the token the chain drafter would draft at each depth), and that chain's
distributions serve every node of the depth. A node off that chain gets candidates conditioned on
a sibling of its parent: an approximation that costs acceptance only, never exactness. Running a
stage per node instead would condition each node on its own parent (the heads are cheap enough);
that is a different drafter, left for when it is measured against this one.

The heads need the target's hidden state at the last kept position; for a tree step that is the
accepted path's last node, not the ``accepted``-th block position a chain uses (`last_kept`).
Drafts are deterministic (top-k, not samples), so verification is exact for greedy and for
sampling (`metaloom.speculative.tree`).
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from metaloom.errors import InvalidParameter
from metaloom.models.engine.llama import Embedding, embed_tokens
from metaloom.models.engine.weights import Weight, linear
from metaloom.models.forward import Ledgers, charge_rows
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import MAX_DRAFT, Draft, DraftState, Verified
from metaloom.speculative.drafters.heads import HeadsDrafter, HeadsState
from metaloom.speculative.heads.model import SpeculatorHeads
from metaloom.speculative.tree import DraftTree, TreeShape

Level = Sequence[tuple[int, float]]  # one head's candidates, best first: (target token id, probability)


@torch.no_grad()
def stage_probs(heads: SpeculatorHeads, z: torch.Tensor, first: torch.Tensor, k: int, embed: Embedding,
                head: Weight) -> torch.Tensor:
    """[B, k, V_d]: each of the first ``k`` stages' distribution over the draft vocabulary, the
    stages fed the greedy chain (`SpeculatorHeads.draft_confident`'s walk). z [B, d]: the
    target's hidden state at the last kept position; first [B]: the token it emitted there."""
    state, token, out = z, first, []
    for i in range(k):
        state = heads.stage(i, state, embed_tokens(embed, token, state.dtype).to(state.dtype))
        logits = linear(heads.out[i](state), head)
        out.append(torch.softmax(logits.float(), dim=-1))
        token = heads.vocab_ids[logits.argmax(dim=-1)]
    return torch.stack(out, dim=1)


def medusa_static(levels: Sequence[Level], widths: Sequence[int], budget: int) -> DraftTree:
    """Breadth first: every node at depth d (0: the root) gets ``levels[d][:widths[d]]`` as its
    children, at most ``budget`` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [-1]
    for level, width in zip(levels, widths, strict=True):
        nxt = []
        for parent in frontier:
            for token, _ in level[:width]:
                if len(tokens) >= budget:
                    return DraftTree(tuple(tokens), tuple(parents))
                tokens.append(token)
                parents.append(parent)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return DraftTree(tuple(tokens), tuple(parents))


def medusa_dynamic(levels: Sequence[Level], budget: int) -> DraftTree:
    """The ``budget`` nodes with the highest product of probabilities along their path, grown
    best-first: a popped node offers its first child and its next sibling (each level is sorted,
    so nothing better is left unoffered; the usual lazy k-best enumeration)."""
    tokens: list[int] = []
    parents: list[int] = []
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-path logp, depth, order, parent, rank, parent logp)
    order = 0

    def offer(parent: int, depth: int, rank: int, base: float) -> None:
        nonlocal order
        if depth < len(levels) and rank < len(levels[depth]) and levels[depth][rank][1] > 0:
            heapq.heappush(heap, (-(base + math.log(levels[depth][rank][1])), depth, order, parent, rank, base))
            order += 1

    offer(-1, 0, 0, 0.0)
    while heap and len(tokens) < budget:
        neg, depth, _, parent, rank, base = heapq.heappop(heap)
        tokens.append(levels[depth][rank][0])
        parents.append(parent)
        offer(parent, depth, rank + 1, base)
        offer(len(tokens) - 1, depth + 1, 0, -neg)
    return DraftTree(tuple(tokens), tuple(parents))


def last_kept(verified: Verified) -> list[int]:
    """Each row's block position whose hidden state produced its last emitted token: the
    accepted path's last node (1 + its index), or 0 (the pending token) when none was accepted.
    The path is found by walking the row's tree down the emitted tokens."""
    out = []
    for b in range(verified.accepted.shape[0]):
        tree = verified.draft.tree(b)
        node = -1
        for j in range(int(verified.accepted[b])):
            want = int(verified.tokens[b, j])
            node = next(c for c in tree.children(node) if tree.tokens[c] == want)
        out.append(node + 1)
    return out


@dataclass(frozen=True)
class HeadsTreeDrafter:
    """Speculator heads (``path``/``heads`` as `HeadsDrafter`) drafting trees of ``shape``; a
    static shape has at most one level per head."""

    shape: TreeShape
    path: str | None = None
    heads: SpeculatorHeads | None = None
    name: str = "heads"
    made: dict[tuple[int, int], tuple[weakref.ref[Any], SpeculatorHeads, Weight]] = field(
        default_factory=dict, compare=False, repr=False)  # `HeadsDrafter.made`: draft heads kept across requests

    def __post_init__(self) -> None:
        self.shape.check_fits(MAX_DRAFT, "heads")

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> HeadsTreeState:
        # min_prob 0: the tree's shape, not a confidence cut, decides what is drafted
        base = HeadsDrafter(self.path, self.heads, self.name, min_prob=0.0, made=self.made).start(target, sampler,
                                                                                               contexts, keys)
        stages = base.heads.config.stages
        if self.shape.nodes is None and len(self.shape.widths) > stages:
            raise InvalidParameter("tree", list(self.shape.widths), f"at most {stages} levels for these heads (one "
                                                                    "per head)")
        if self.shape.nodes is None and max(self.shape.widths) > base.heads.config.draft_vocab:
            raise InvalidParameter("tree", list(self.shape.widths), f"widths at most the heads' draft vocabulary "
                                                                    f"({base.heads.config.draft_vocab})")
        return HeadsTreeState(base, self.shape)  # no hidden state yet: nothing drafted until the first verify


class HeadsTreeState:
    needs_hidden = True  # the decode loop fills `Verified.hidden`

    def __init__(self, base: HeadsState, shape: TreeShape) -> None:
        self.base = base  # the heads, the target's embedding and head rows, each row's hidden state
        self.shape = shape

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        base, heads = self.base, self.base.heads
        budget = max(limits, default=0)
        depth = (len(self.shape.widths) if self.shape.nodes is None
                 else min(heads.config.stages, self.shape.nodes, budget))
        known = [True] * len(contexts) if base.known is None else base.known.tolist()
        if budget == 0 or base.hidden is None or depth == 0 or not any(known):
            return Draft.from_trees([DraftTree((), ())] * len(contexts))
        first = torch.as_tensor([c[-1] for c in contexts], dtype=torch.long, device=heads.vocab_ids.device)
        probs = stage_probs(heads, base.hidden.float(), first, depth, base.embed, base.head)  # [B, depth, V_d]
        k = (max(self.shape.widths) if self.shape.nodes is None else min(self.shape.nodes, budget))
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        ids, values = heads.vocab_ids[top.indices].tolist(), top.values.tolist()  # [B, depth, k]
        trees = []
        for b, limit in enumerate(limits):
            if limit <= 0 or not known[b]:
                trees.append(DraftTree((), ()))
                continue
            levels = [list(zip(ids[b][d], values[b][d], strict=True)) for d in range(depth)]
            trees.append(medusa_static(levels, self.shape.widths, limit) if self.shape.nodes is None
                         else medusa_dynamic(levels, min(limit, self.shape.nodes)))
        charge_rows(ledger, len(contexts), flops=heads.flops_per_token() * depth)
        return Draft.from_trees(trees)

    def observe(self, verified: Verified) -> None:
        if verified.hidden is None:  # a loop that does not report hidden states: draft nothing
            self.base.hidden = None
            return
        at = torch.as_tensor(last_kept(verified), dtype=torch.long, device=verified.hidden.device)
        rows = torch.arange(verified.hidden.shape[0], device=verified.hidden.device)
        self.base.hidden = verified.hidden[rows, at]
        self.base.known = None
        self.base.rows = self.base.hidden.shape[0]

    def select(self, rows: Sequence[int]) -> HeadsTreeState:
        return HeadsTreeState(self.base.select(rows), self.shape)

    def join(self, other: DraftState) -> HeadsTreeState:
        assert isinstance(other, HeadsTreeState)
        return HeadsTreeState(self.base.join(other.base), self.shape)
