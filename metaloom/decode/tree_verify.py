"""A speculative step over token trees (`metaloom.speculative.tree`): the pipeline's
distribution at every node, constraint masks along every branch, and each row's accepted path.

The chain step (`metaloom.decode.select.verify`) walks a draft's positions in order; a tree's
node ``i`` follows its parent instead, so:

- the pipeline state at block position ``i + 1`` (after node ``i``) is the state at its
  parent's position advanced by node ``i``'s token (penalties, DRY and mirostat see each branch
  as if it had been drawn);
- a row's constraint cursor walks the tree depth first, advancing into a node and rolling back
  when it leaves (its mask at every node is the branch's), and ends where it started;
- a node whose own position allows no token is no candidate (with its subtree): moving into it
  would leave nothing to draw after it.

Acceptance is `accept_walk` per row: the target's own token at each position (argmax, or plain
sampling's draw) picks the child to move into, so the emitted tokens are plain decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from metaloom.constrain import Constraint
from metaloom.decode.select import live_cursors
from metaloom.models.kernels import draw as c_draw
from metaloom.sampling.pipeline import Sampler
from metaloom.sampling.state import SamplingState
from metaloom.speculative.core import gather_states, plain_draws
from metaloom.speculative.drafter import Draft
from metaloom.speculative.tree import DraftTree, accept_walk, block_depths


@dataclass(frozen=True)
class TreeVerified:
    """Row b emits ``tokens[b][:n]`` where n = len(tokens[b]); emitted token j was drawn at block
    position ``positions[b][j]`` (0, the pending token's, then the accepted path's nodes + 1),
    which are also the block positions its cache keeps. ``logprobs`` [B, T, V]: the pipeline's at every
    block position; ``state``: the pipeline state after the step; ``errors``: rows that could
    not go on."""

    tokens: list[list[int]]
    positions: list[list[int]]
    logprobs: torch.Tensor
    state: SamplingState
    errors: dict[int, str]

    @property
    def accepted(self) -> list[int]:
        return [len(p) - 1 for p in self.positions]


def tree_masks(cursors: Sequence[Constraint | None], draft: Draft, vocab: int,
               device: torch.device) -> list[torch.Tensor | None] | None:
    """Each block position's allowed tokens [B, V] (T = K + 1 entries), each row's cursor walked
    depth first through its tree and left where it was; None when no row is constrained."""
    k = draft.tokens.shape[1]
    out = torch.ones(k + 1, len(cursors), vocab, dtype=torch.bool)
    any_mask = False
    for b, c in enumerate(cursors):
        if c is not None:
            any_mask |= _walk(c, draft.tree(b), -1, out[:, b])
    return [out[i].to(device) for i in range(k + 1)] if any_mask else None


def tree_logprobs(sampler: Sampler, scores: torch.Tensor, draft: Draft, state: SamplingState,
                  generators: Sequence[torch.Generator | None], position_masks: list[torch.Tensor | None] | None,
                  ) -> tuple[torch.Tensor, list[SamplingState]]:
    """(logprobs [B, T, V], states): position i processed with ``states[i]``, the state at its
    parent's position advanced by its token (rows whose tree is smaller get garbage past it)."""
    t = scores.shape[1]
    if sampler.plain and position_masks is None:
        return torch.log_softmax(scores.float(), dim=-1), [state] * t
    assert draft.parents is not None
    rows = torch.arange(scores.shape[0], device=scores.device)
    states, out = [state], []
    for i in range(t):
        mask = position_masks[i] if position_masks is not None else None
        out.append(sampler.process(scores[:, i], states[i], mask=mask, generators=generators))
        if i + 1 < t:  # the state after node i: its parent's position's state, advanced by its token
            parent = (draft.parents[:, i].clamp(min=-1) + 1).to(scores.device)
            parent = torch.minimum(parent, torch.full_like(parent, i))  # padding nodes: any earlier one
            before = gather_states(states, parent)
            lp_parent = torch.stack(out)[parent, rows]
            states.append(sampler.advance(before, draft.tokens[:, i].to(scores.device), lp_parent))
    return torch.stack(out, dim=1), states


def verify_tree(sampler: Sampler, state: SamplingState, scores: torch.Tensor, draft: Draft,
                cursors: Sequence[Constraint | None] | None, generators: Sequence[torch.Generator | None],
                keys: np.ndarray | None = None) -> TreeVerified:
    """Accept a path of each row's tree and emit one more token. ``scores`` [B, T, V] over
    ``[pending, nodes]`` (the tree-masked verify forward); ``keys`` [B, 2] int64 on the host:
    each row's random key and the position of its next token, for plain sampling's draw at every
    block position (`metaloom.sampling.counter`; None only when every row is greedy);
    ``generators``: the pipeline's own coins (XTC).

    The target's own token at every block position (argmax, or plain sampling's draw at the
    position the node's depth gives) and which positions allow no token come to the host in one
    copy; the walks (`accept_walk`) run there: one device wait a step, however many children."""
    errors: dict[int, str] = {}
    position_masks = None
    if cursors is not None:
        live = live_cursors(cursors, scores.shape[-1], scores.device, errors)
        position_masks = tree_masks(live, draft, scores.shape[-1], scores.device)
    lp, states = tree_logprobs(sampler, scores, draft, state, generators, position_masks)
    b, t = lp.shape[:2]
    trees = draft.trees()
    values, own = c_draw.row_max(lp)
    if not sampler.all_greedy:
        if keys is None:
            raise ValueError("sampled rows need their random keys (keys)")
        depths = np.zeros((b, t), dtype=np.int64)
        for r, tree in enumerate(trees):
            depths[r, :len(tree) + 1] = block_depths(tree)
        own = torch.where(sampler.greedy.to(lp.device)[:, None], own, plain_draws(lp, keys, depths))
    host = torch.stack([own.double(), (~(values > float("-inf"))).double()]).tolist()  # the step's one wait
    tokens: list[list[int]] = []
    positions: list[list[int]] = []
    for r in range(b):
        if host[1][r][0] and r not in errors:
            errors[r] = "no token can be drawn at this position (the constraint or the pipeline allows none)"
        if r in errors:
            tokens.append([0])
            positions.append([0])
            continue
        kept = _pruned(trees[r], host[1][r][1:])
        index = kept.index or list(range(len(kept.tree)))  # the kept nodes' numbers in the draft
        got = accept_walk(kept.tree, [int(host[0][r][0]), *(int(host[0][r][i + 1]) for i in index)])
        tokens.append(list(got.tokens))
        positions.append([0, *(index[i] + 1 for i in got.path)])
    # the state after the step: each row's state at its last kept position, advanced by its final token
    last = torch.tensor([p[-1] for p in positions], device=lp.device)
    final = torch.tensor([tk[-1] for tk in tokens], device=lp.device)
    rows = torch.arange(b, device=lp.device)
    picked = states[0] if all(s is states[0] for s in states) else gather_states(states, last)  # plain: one state
    after = sampler.advance(picked, final, lp[rows, last])
    return TreeVerified(tokens, positions, lp, after, errors)


def _walk(cursor: Constraint, tree: DraftTree, node: int, out: torch.Tensor) -> bool:
    """Write the cursor's mask at ``node``'s block position into ``out`` [T, V], then visit each
    allowed child (advance, recurse, roll back); True when some mask was not all-allowed."""
    allowed = None if cursor.unconstrained else cursor.mask()
    if allowed is not None:
        out[node + 1] = allowed
    found = allowed is not None
    if cursor.done():
        return found
    for child in tree.children(node):
        token = tree.tokens[child]
        if allowed is not None and not bool(allowed[token]):
            continue  # forbidden here: p is 0, so it is never accepted and its subtree never read
        cursor.advance(token)
        try:
            found |= _walk(cursor, tree, child, out)
        finally:
            cursor.rollback(1)
    return found


@dataclass(frozen=True)
class _Pruned:
    tree: DraftTree
    index: list[int]  # the kept nodes' indices in the original tree ([] when none was pruned)


def _pruned(tree: DraftTree, empty: Sequence[bool]) -> _Pruned:
    """``tree`` without the nodes whose own position allows no token, and their subtrees."""
    dead = [False] * len(tree)
    for i, p in enumerate(tree.parents):
        dead[i] = bool(empty[i]) or (p >= 0 and dead[p])
    if not any(dead):
        return _Pruned(tree, [])
    index = [i for i in range(len(tree)) if not dead[i]]
    new = {old: n for n, old in enumerate(index)}
    return _Pruned(DraftTree(tuple(tree.tokens[i] for i in index),
                             tuple(-1 if tree.parents[i] < 0 else new[tree.parents[i]] for i in index)), index)
