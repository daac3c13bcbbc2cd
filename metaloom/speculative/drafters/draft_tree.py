"""Token trees from a draft model (``--speculative draft|quantized --tree ...``).

- ``static:W1,W2,...`` — SpecInfer's expansion (Miao et al. 2024): the draft model's top-W1
  tokens after the pending token, its top-W2 after each of those, and so on.
- ``dynamic:NODES`` — DySpec (Xiong et al. 2024, "DySpec: Faster Speculative Decoding with
  Dynamic Token Tree Structure"): best-first growth, each round adding the candidates with the
  highest draft probability of their whole path (the product of the draft's probabilities
  along it), until NODES nodes; a node's children become candidates once it is scored.

Each round scores the tree so far in one forward of the draft model over ``[pending, nodes]``
with the tree attention mask (every node sees its ancestors only), then drops that block from
the draft's cache again: the next step re-reads the accepted tokens with the context (the
draft's cache holds only verified context between steps, as the chain drafter's does).

The proposals are the draft's top tokens, not samples, so the tree is deterministic and the
target's acceptance (`metaloom.speculative.tree`) is exact for sampled rows too.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.forward import Ledgers, charged_forward, charged_forward_both, takes_trees
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import Draft, DraftState
from metaloom.speculative.drafters.draft_model import DraftModelDrafter, DraftModelState
from metaloom.speculative.tree import DraftTree, TreeShape

PER_ROUND = 4  # dynamic: nodes added per round (one draft forward each)


@dataclass(frozen=True)
class DraftTreeDrafter:
    """The draft model ``model`` growing trees of ``shape``."""

    model: LanguageModel
    shape: TreeShape
    name: str = "draft"
    feed: list[float] = field(default_factory=list, compare=False, repr=False)  # `measure_feed`'s, once

    def measure_feed(self) -> float:
        """The draft model's seconds a context token (`DraftModelDrafter.measure_feed`): the cost
        model prices a tree drafter's catch-up as a chain drafter's."""
        return self._chain().measure_feed()

    def _chain(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.model, self.name, self.feed)

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> DraftState:
        if not takes_trees(self.model):
            raise UnsupportedModel(f"{type(self.model).__name__} takes no token trees (a native draft model does)")
        return DraftTreeState(self._chain().start(target, sampler, contexts, keys), self.shape)


class DraftTreeState:
    def __init__(self, base: DraftModelState, shape: TreeShape) -> None:
        self.base = base
        self.shape = shape

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        base = self.base
        b = len(contexts)
        device = base.model.device
        if max(limits, default=0) == 0:
            return Draft.from_trees([DraftTree((), ())] * b, device)
        todo = base._sync(contexts)  # context tokens the draft has not read, the pending one last
        feed = [t[:-1] for t in todo]
        if any(feed):
            width = max(len(t) for t in feed)
            tokens = torch.zeros(b, width, dtype=torch.long, device=device)
            for i, t in enumerate(feed):
                tokens[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
            valid = torch.tensor([len(t) for t in feed], dtype=torch.long, device=device)
            charged_forward(base.model, tokens, base.cache, ledger, valid=valid)
            for i, t in enumerate(feed):
                base.fed[i].extend(t)
        roots = [t[-1] for t in todo]
        growth = [_Growth(self.shape, limit) for limit in limits]
        kept = base.cache.lengths.clone()
        for _ in range(64):  # rounds; a tree grows at least a node a round, and is at most MAX_DRAFT nodes
            if not any(g.wants_scores for g in growth):
                break
            trees = [g.tree() for g in growth]
            draft = Draft.from_trees(trees, device)
            block = torch.cat([torch.tensor(roots, device=device)[:, None], draft.tokens], dim=1)
            valid = torch.tensor([len(t) + 1 if g.wants_scores else 0 for t, g in zip(trees, growth, strict=True)],
                                 device=device)
            logits, _, _ = charged_forward_both(base.model, block, base.cache, ledger, valid=valid,
                                                tree=draft.tree_attention(block.shape[1]))
            base.cache.truncate(kept)  # the block leaves the draft's cache again
            flat = logits.float().reshape(b * block.shape[1], -1)
            logp = torch.log_softmax(base._fit(flat), -1).view(b, block.shape[1], -1)
            for i, g in enumerate(growth):
                if g.wants_scores:
                    g.grow(logp[i])
        return Draft.from_trees([g.tree() for g in growth], device)

    def catch_up(self, contexts: Sequence[Sequence[int]]) -> float:
        return self.base.catch_up(contexts)

    def ahead(self, contexts: Sequence[Sequence[int]]) -> int | None:
        return self.base.ahead(contexts)

    def observe(self, verified: object) -> None:
        pass

    def select(self, rows: Sequence[int]) -> DraftTreeState:
        return DraftTreeState(self.base.select(rows), self.shape)

    def join(self, other: DraftState) -> DraftTreeState:
        assert isinstance(other, DraftTreeState)
        return DraftTreeState(self.base.join(other.base), self.shape)


class _Growth:
    """One row's tree as it grows, with the nodes whose children are still to be read."""

    def __init__(self, shape: TreeShape, budget: int) -> None:
        self.shape = shape
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.logp: list[float] = []  # each node's path log-probability under the draft
        self.unread = [-1] if budget > 0 else []  # nodes (-1: the root) whose children are not yet known
        self.candidates: list[tuple[float, int, int, int]] = []  # dynamic: (-path logp, order, parent, token)
        self.order = 0

    @property
    def wants_scores(self) -> bool:
        return bool(self.unread) and len(self.tokens) < self.budget

    def tree(self) -> DraftTree:
        return DraftTree(tuple(self.tokens), tuple(self.parents))

    def _add(self, parent: int, token: int, logp: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logp.append(logp)

    def grow(self, logp: torch.Tensor) -> None:
        """``logp`` [1 + nodes, V]: the draft's log-probabilities after the root and each node."""
        unread, self.unread = self.unread, []
        if self.shape.nodes is None:  # static: the top-W children of the unread nodes, by depth
            for node in unread:
                depth = 0 if node < 0 else self._depth(node)
                if depth >= len(self.shape.widths):
                    continue
                base = 0.0 if node < 0 else self.logp[node]
                top = logp[node + 1].topk(self.shape.widths[depth])
                for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                    if len(self.tokens) >= self.budget or not math.isfinite(value):
                        break
                    self._add(node, token, base + value)
                    self.unread.append(len(self.tokens) - 1)
            return
        for node in unread:  # dynamic: the new nodes' best children join the candidates
            base = 0.0 if node < 0 else self.logp[node]
            top = logp[node + 1].topk(min(PER_ROUND, logp.shape[-1]))
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if math.isfinite(value):
                    heapq.heappush(self.candidates, (-(base + value), self.order, node, token))
                    self.order += 1
        for _ in range(PER_ROUND):  # the best candidates of all become nodes
            if not self.candidates or len(self.tokens) >= min(self.budget, self.shape.nodes):
                break
            neg, _, parent, token = heapq.heappop(self.candidates)
            self._add(parent, token, -neg)
            self.unread.append(len(self.tokens) - 1)

    def _depth(self, node: int) -> int:
        depth = 1
        while self.parents[node] >= 0:
            node = self.parents[node]
            depth += 1
        return depth


def draft_tree_drafter(model: LanguageModel, shape: TreeShape, name: str = "draft") -> DraftTreeDrafter:
    if shape.nodes is None and max(shape.widths) > 64:
        raise InvalidParameter("tree", list(shape.widths), "widths at most 64")
    return DraftTreeDrafter(model, shape, name)
