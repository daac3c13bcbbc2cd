"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of
Large Language Models with Token Recycling"): drafts from the target's own past candidates,
with no draft model and no training.

Every verify forward computes the target's distribution after each token it reads, and plain
decoding throws all but one token of it away. Token Recycling keeps, for every token ``x`` of
the vocabulary, the ``k`` most likely tokens the target last put after ``x`` (an adjacency
matrix ``M [V, k]``, updated from every forward it observes, kept across requests as the paper
keeps it). A draft is a tree grown from the row's pending token by breadth-first expansion
over ``M``: a node holding ``x`` gets the first ``widths[d]`` candidates of ``M[x]`` as children
at depth ``d + 1`` (a static tree; ``widths`` all 1 is a chain), until the node budget is spent.
Drafts are deterministic, so verification is exact for greedy and for sampling
(`metaloom.speculative.tree`). Tokens never seen yet have no candidates: the first steps of a
fresh drafter propose little, and it learns as it goes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from metaloom.errors import InvalidParameter
from metaloom.models.forward import Ledgers
from metaloom.models.kernels import draw as c_draw
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import Draft, DraftState, Verified
from metaloom.speculative.tree import DraftTree, TreeShape

CANDIDATES = 8  # k: candidates kept per token (the paper's matrix width)
DEFAULT_WIDTHS = (4, 3, 2, 2, 1, 1, 1)  # a static tree of up to 4 + 12 + 24 + 48 + ... nodes, cut by the budget


class RecyclingDrafter:
    """Token Recycling with a static tree of ``shape`` (default `DEFAULT_WIDTHS`)."""

    def __init__(self, shape: TreeShape | None = None) -> None:
        shape = shape or TreeShape(DEFAULT_WIDTHS)
        if shape.nodes is not None:
            raise InvalidParameter("tree", f"dynamic:{shape.nodes}", "static:W1,W2,... for recycling (a dynamic tree "
                                                                      "grows by draft probabilities, which it has none of)")
        if max(shape.widths) > CANDIDATES:
            raise InvalidParameter("tree", list(shape.widths), f"widths at most {CANDIDATES} for recycling (the "
                                                                "candidates it keeps a token)")
        self.shape = shape
        self.table: torch.Tensor | None = None  # [V, k] long, -1 = no candidate yet
        self.lock = threading.Lock()

    @property
    def name(self) -> str:
        return "recycling"

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> DraftState:
        with self.lock:
            if self.table is None or self.table.shape[0] != target.vocab_size:
                self.table = torch.full((target.vocab_size, CANDIDATES), -1, dtype=torch.long)
        return RecyclingState(self)

    def grow(self, root: int, budget: int) -> DraftTree:
        """The static tree from ``root`` over the current matrix, at most ``budget`` nodes."""
        assert self.table is not None
        table = self.table.numpy()  # a view: a numpy row costs a tenth of a torch one right after a forward
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, root)]
        for width in self.shape.widths:
            nxt = []
            for node, token in frontier:
                for cand in table[token, :width].tolist():
                    if cand < 0 or len(tokens) >= budget:
                        break
                    tokens.append(cand)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, cand))
            frontier = nxt
            if not frontier or len(tokens) >= budget:
                break
        return DraftTree(tuple(tokens), tuple(parents))

    def learn(self, tokens: Sequence[int] | torch.Tensor, logits: torch.Tensor) -> None:
        """Row ``M[tokens[i]]`` = the ``k`` most likely tokens after it (``logits[i]`` [V])."""
        assert self.table is not None
        k = min(CANDIDATES, logits.shape[-1])  # a vocabulary smaller than the matrix is wide keeps all of it
        top = c_draw.topk(logits.reshape(-1, logits.shape[-1]), k).numpy()
        ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        with self.lock:
            # numpy rows, in order (a token read twice keeps its last candidates): each torch
            # call right after a forward costs tens of microseconds, and Token Recycling's
            # update is charged to the cost model's budget every step (issue 47)
            table = self.table.numpy()
            for i, token in enumerate(ids):
                table[token, :k] = top[i]


class RecyclingState:
    """Per batch: nothing of its own (the matrix is the drafter's)."""

    learns_only = True  # observe only updates the matrix (`metaloom.speculative.drafter`)

    def __init__(self, drafter: RecyclingDrafter) -> None:
        self.drafter = drafter
        self.empty: Draft | None = None  # the draft of a step no root has candidates for (frozen: shared)

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        table = self.drafter.table
        assert table is not None
        roots = [int(ctx[-1]) if limit > 0 and ctx else -1 for ctx, limit in zip(contexts, limits, strict=True)]
        first = table.numpy()[:, 0]
        if all(r < 0 or first[r] < 0 for r in roots):
            # a fresh matrix knows no candidates yet: nothing to grow, and the drafting time that
            # the cost model charges stays a few microseconds (a tree of nothing built every step
            # cost a fresh drafter a tenth of SmolLM2's step, enough to spend its budget)
            if self.empty is None or self.empty.lengths.shape[0] != len(roots):
                self.empty = Draft.from_trees([DraftTree((), ())] * len(roots))
            return self.empty
        trees = [self.drafter.grow(r, limit) if r >= 0 else DraftTree((), ())
                 for r, limit in zip(roots, limits, strict=True)]
        return Draft.from_trees(trees)

    def observe(self, verified: Verified) -> None:
        # the pending token each row read first (the token emitted before this step's block)
        if verified.pending is None:
            return
        logits = verified.logits
        if logits.shape[1] == 1:  # a plain step (nothing drafted): each row read its pending token
            self.drafter.learn(verified.pending, logits[:, 0])
            return
        # each row's tokens as lists and its logits as a slice of the verify's own tensor: no
        # copy of the logits (a row of Qwen's is 600 KB), as little tensor work as a step allows
        pending = verified.pending.tolist()
        drafted = verified.draft.tokens.tolist()
        for b, n in enumerate(verified.draft.lengths.tolist()):
            self.drafter.learn([pending[b], *drafted[b][:n]], logits[b, :n + 1])

    def select(self, rows: Sequence[int]) -> DraftState:
        return self

    def join(self, other: DraftState) -> DraftState:
        return self
