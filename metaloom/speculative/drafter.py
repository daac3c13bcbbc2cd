"""The seam between speculative decoding and whatever proposes tokens.

A `Drafter` is configuration (and weights, if it has any); `Drafter.start` makes a
`DraftState`, the mutable per-batch state (a draft model's KV cache, an n-gram index, Jacobi
guesses) that the decode loop passes around explicitly, like the target's KV cache. Each step
the loop calls::

    draft = state.propose(contexts, limits, ledger)   # up to limits[b] tokens for row b
    ... one target forward over [pending, draft], acceptance ...
    state.observe(verified)                            # what the target said and kept

``contexts[b]`` is row b's full token sequence so far (prompt, then every emitted token; the
last one is the pending token the target has not seen yet). A drafter that runs a model
charges its forwards to ``ledger`` through `metaloom.models.forward.charged_forward`.

A drafter that samples (a draft model at temperature > 0) returns ``Draft.probs``, the
distribution q it drew each token from; deterministic drafters return None (q = one-hot).
The verification needs neither: it compares each drafted token with the target's own token
there (`metaloom.speculative.core`). Exactness never depends on the drafter: a bad draft only
costs speed.

A state with a true ``needs_hidden`` attribute (speculator heads, Medusa-style, Cai et al.
2024) gets ``Verified.hidden``, the target's final hidden states at every verified position:
the loop then verifies through `charged_forward_hidden` (models with ``forward_hidden``).
`Verified.logits` is the target's output at the same positions (Jacobi reads its guesses there).

A state with a true ``learns_only`` attribute keeps no per-row state in `DraftState.observe`:
it only learns from what it sees (Token Recycling's candidate table). The cost model
(`metaloom.speculative.planned`) skips such an observation while that drafter is idle, since it
costs a step's time and feeds no draft soon.

A state with a ``catch_up(contexts)`` method must feed context before it drafts (a draft
model: at its first proposal, the whole prompt) and returns the seconds that takes. The cost
model tries such a drafter only when the exploration budget has room for them and, where the
state's ``ahead(contexts)`` says how many tokens the rows may still produce, when they are a
small share of what plain decoding would take for those (`CATCH_UP_SHARE`).

A drafter whose drafts carry confidence classes (`Draft.levels`) may have a ``class_priors``
attribute: per class, the first drafted token's acceptance and each next one's ratio to it,
which the cost model starts from (`metaloom.speculative.acceptance`; prompt lookup's, by the
length its suffix matched).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from metaloom.models.forward import Ledgers
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.tree import DraftTree, attention_mask

MAX_DRAFT = 64  # the most tokens one step may draft (bounds the caches' spare room)
LEVELS = 4  # confidence classes a drafter may give its drafts (`Draft.levels`)


@dataclass(frozen=True)
class Draft:
    """Row b proposes ``tokens[b, :lengths[b]]``; entries past that are padding (0). With
    ``parents`` the draft is a token tree (`metaloom.speculative.tree`): node i of row b follows
    node ``parents[b, i]`` (-1: the pending token), nodes in topological order, siblings
    distinct; a tree is deterministic (no ``probs``). Without, node i follows node i - 1."""

    tokens: torch.Tensor  # [B, K] long
    lengths: torch.Tensor  # [B] long, 0 .. K
    probs: torch.Tensor | None = None  # [B, K, V] float: q for sampled rows; None = one-hot (deterministic)
    parents: torch.Tensor | None = None  # [B, K] long: a token tree's parents (None: chains)
    # [B] ints in [0, LEVELS): how sure the drafter is of each row's draft, in classes (prompt
    # lookup: the matched n-gram's length - 1); the cost model learns acceptance per class
    levels: tuple[int, ...] | None = None

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], device: torch.device | str = "cpu") -> Draft:
        """A tree draft from per-row trees."""
        # padded on the host as lists, then one tensor each: a drafter proposes every step, and
        # per-row tensor writes cost a small model's step a percent
        k = max((len(t) for t in trees), default=0)
        tokens = torch.tensor([[*t.tokens, *[0] * (k - len(t))] for t in trees], dtype=torch.long).reshape(len(trees), k)
        parents = torch.tensor([[*t.parents, *[-1] * (k - len(t))] for t in trees],
                               dtype=torch.long).reshape(len(trees), k)
        lengths = torch.tensor([len(t) for t in trees], dtype=torch.long)
        return cls(tokens.to(device), lengths.to(device), parents=parents.to(device))

    def tree(self, row: int) -> DraftTree:
        """Row ``row``'s tree (its first ``lengths[row]`` nodes); a chain draft's row as a chain."""
        n = int(self.lengths[row])
        tokens = tuple(self.tokens[row, :n].tolist())
        if self.parents is None:
            return DraftTree.chain(tokens)
        return DraftTree(tokens, tuple(self.parents[row, :n].tolist()))

    def trees(self) -> list[DraftTree]:
        """Every row's tree (`tree`), read to the host in one copy."""
        k = self.tokens.shape[1]
        parents = self.parents if self.parents is not None else torch.arange(-1, k - 1).expand(self.tokens.shape[0], k)
        host = torch.cat([self.lengths[:, None].to(self.tokens.device), self.tokens,
                          parents.to(self.tokens.device)], dim=1).tolist()
        return [DraftTree(tuple(row[1:1 + row[0]]), tuple(row[1 + k:1 + k + row[0]])) for row in host]

    def tree_attention(self, width: int) -> torch.Tensor:
        """[B, width, width] bool: each row's verify block ``[pending, nodes]`` as a tree mask
        (`metaloom.speculative.tree.attention_mask`); past a row's tree, positions see only the
        root and themselves (padding, written to the scratch slot and never read)."""
        out = torch.eye(width, dtype=torch.bool).repeat(self.tokens.shape[0], 1, 1)
        out[:, :, 0] = True
        for b, tree in enumerate(self.trees()):
            out[b, :len(tree) + 1, :len(tree) + 1] = attention_mask(tree)
        return out.to(self.tokens.device)

    @classmethod
    def from_lists(cls, drafts: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> Draft:
        """A deterministic draft from per-row token lists."""
        # padded as lists, then one tensor each (as `from_trees`): per-row writes cost prompt
        # lookup 0.08 ms a SmolLM2 step, right after a forward when every torch call is dear
        k = max((len(d) for d in drafts), default=0)
        tokens = torch.tensor([[*d, *[0] * (k - len(d))] for d in drafts], dtype=torch.long).reshape(len(drafts), k)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return cls(tokens.to(device), lengths.to(device))


@dataclass(frozen=True)
class Verified:
    """One verification step, as the drafter sees it afterwards."""

    draft: Draft
    logits: torch.Tensor  # [B, K+1, V]: the target's raw logits over [pending, d_1 .. d_K]
    accepted: torch.Tensor  # [B] long: draft tokens kept
    tokens: torch.Tensor  # [B, K+1] long: row b emitted tokens[b, :accepted[b] + 1]
    # [B, K+1, d]: only for states with ``needs_hidden`` (see module doc); by block position, so
    # after a tree step the last kept one is the accepted path's last node, not ``accepted``
    hidden: torch.Tensor | None = None
    pending: torch.Tensor | None = None  # [B] long: the token each row read first (block position 0)


@runtime_checkable
class DraftState(Protocol):
    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        """At most ``limits[b]`` tokens for row b (0: propose nothing)."""
        ...

    def observe(self, verified: Verified) -> None:
        """Called after every verification (drafters that learn from the target's output)."""
        ...

    def select(self, rows: Sequence[int]) -> DraftState:
        """The state of a sub-batch (rows in the order given), when finished rows are dropped."""
        ...

    def join(self, other: DraftState) -> DraftState:
        """This state's rows, then ``other``'s (a state of the same drafter, `Drafter.start`ed for
        rows joining the running batch)."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for a target model."""

    @property
    def name(self) -> str:
        """What reports call it (the registry name, `metaloom.speculative.registry.DRAFTERS`, or a variant)."""
        ...

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> DraftState:
        """A state for a batch whose rows start from ``contexts`` (the prompts; the loop has
        not drawn anything yet) and are sampled by ``sampler``; ``keys[b]``: row b's random key
        (a drafter that samples draws at plain sampling's uniform for the row's key and the
        drafted token's output position, `metaloom.sampling.counter`: the target's own draw
        there is made at the same uniform, `metaloom.speculative.core`)."""
        ...
