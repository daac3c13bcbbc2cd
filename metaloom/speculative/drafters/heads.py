"""Speculator heads draft from the target's own last hidden state: no second model, no cache.

The heads (`metaloom.speculative.heads.model`: Medusa's heads made hierarchical, each stage fed
the previous stage's token) read ``z``, the target's final hidden state at the last position it
verified and kept, and the token it emitted there (the pending token), and propose up to
``stages`` tokens. After each verification the drafter keeps, per row, the hidden state at the
position of the last kept token (`Verified.hidden`, which the decode loop fills because this
state sets ``needs_hidden``). The first step after the prefill has no hidden state yet, so it
drafts nothing (one plain step).

Drafts are deterministic (argmax of each stage; q = one-hot), so greedy rows decode exactly as
plain greedy and sampled rows exactly as plain sampling (the core's acceptance rule).

`HeadsDrafter()` with no file uses the heads shipped for the target (matched by architecture and
an embedding fingerprint, `metaloom.speculative.heads.shipped_heads`): SmolLM2-135M-Instruct,
the default model, has them; another model needs ``metaloom train-speculator`` and ``path``.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.engine.llama import Embedding, plain_weight
from metaloom.models.engine.weights import Weight
from metaloom.models.forward import Ledgers, charge_rows
from metaloom.models.kernels.quant import PANEL, QuantWeight
from metaloom.models.protocols import LanguageModel
from metaloom.sampling.pipeline import Sampler
from metaloom.speculative.drafter import Draft, DraftState, Verified
from metaloom.speculative.heads.model import SpeculatorHeads, load_heads, matches
from metaloom.speculative.heads.shipped import shipped_heads


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> SpeculatorHeads:
    """Heads files are read once per process (keyed by modification time, so a retrained file is re-read)."""
    return load_heads(path)


def heads_for(target: LanguageModel, path: str | None = None) -> SpeculatorHeads:
    """The heads in ``path``, or the shipped heads matching ``target`` (`NoSpeculatorHeads` if none)."""
    if path is None:
        path = shipped_heads(target)
    elif not os.path.exists(path):
        raise UnsupportedModel(f"speculator heads file {path!r} does not exist")
    heads = _load(os.path.abspath(path), os.path.getmtime(path))
    if not matches(heads.config, target):
        raise UnsupportedModel(f"speculator heads {path} were trained for {heads.config.model_name or 'another model'} "
                               f"{heads.config.signature}, which does not match this target; "
                               "train heads for it with `metaloom train-speculator`")
    return heads


@dataclass(frozen=True, eq=False)
class FirstOutputs:
    """``weight``'s first ``n`` outputs: a draft head padded to whole panels of `PANEL` rows."""

    weight: QuantWeight
    n: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight(x)[..., :self.n]

    def numel(self) -> int:
        return self.n * self.weight.in_features


def draft_head(lm_head: Weight, ids: torch.Tensor) -> Weight:
    """The target's LM head rows ``ids`` (the heads' draft vocabulary), as the heads' stages
    multiply them (`metaloom.models.engine.weights.linear`). A quantised head keeps its blocks,
    the same weights, and its kernels: SmolLM2's 4,935 rows of Q8_0 are 3 MB, where dequantised
    to float32 they were 11 MB, and a stage's product took 152 us against 31 (int8 activations,
    AVX-512 Zen 5, scripts/heads_stage.py); heads drafting almost nothing on free text ran at
    0.95x plain greedy with the float rows (issue 47). Padded to whole panels (the fast layout),
    the extra outputs dropped."""
    w = plain_weight(lm_head)
    if isinstance(w, torch.Tensor):
        return w[ids.to(w.device)].float()
    if not isinstance(w, QuantWeight):
        raise UnsupportedModel(f"speculator heads multiply the LM head's rows; a {type(w).__name__} head has none")
    g = w.gguf()
    pad = (-ids.numel()) % PANEL
    rows = torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids
    head = QuantWeight(g.qtype, g.blocks[rows.to(g.blocks.device)].contiguous(), g.in_features,
                       activations=w.activations).panelled()
    return FirstOutputs(head, ids.numel()) if pad else head


@dataclass(frozen=True)
class HeadsDrafter:
    """``path``: a heads file from ``metaloom train-speculator``; None: the shipped heads for the
    target. ``heads``: already loaded heads (tests, training scripts); overrides ``path``."""

    path: str | None = None
    heads: SpeculatorHeads | None = None
    name: str = "heads"
    # a draft stops at the first stage whose guess the heads give less than this probability
    # (0: always draft every stage); see `SpeculatorHeads.draft_confident`. 0.4 measured best of
    # 0 / 0.4 / 0.7 on the default model (bf16, 5 prompts): 1.03-1.06x plain greedy against
    # 0.87-0.88x drafting every stage, whose guesses are mostly rejected there
    min_prob: float = 0.4
    # the draft heads made, per (target head, heads): (the head, weakly, the heads, their draft
    # head), kept across the requests this drafter serves rather than gathered at each `start`
    made: dict[tuple[int, int], tuple[weakref.ref[Any], SpeculatorHeads, Weight]] = field(
        default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_prob < 1.0:
            raise InvalidParameter("min_prob", self.min_prob, "a probability in [0, 1)")

    def draft_head(self, lm_head: Weight, heads: SpeculatorHeads) -> Weight:
        """`draft_head` for ``heads`` on ``lm_head``, made once (an unloaded model's entries go)."""
        for gone in [k for k, v in self.made.items() if v[0]() is None]:
            del self.made[gone]
        key = (id(lm_head), id(heads))
        got = self.made.get(key)
        if got is None or got[0]() is not lm_head or got[1] is not heads:
            got = self.made[key] = (weakref.ref(lm_head), heads, draft_head(lm_head, heads.vocab_ids))
        return got[2]

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> HeadsState:
        for attr in ("embed", "lm_head", "forward_hidden"):
            if not hasattr(target, attr):
                raise UnsupportedModel(f"speculator heads need the native model (embedding, LM head and hidden "
                                       f"states); {type(target).__name__} has no {attr!r}")
        heads = self.heads if self.heads is not None else heads_for(target, self.path)
        device = target.device
        heads = heads.to(device)
        embed = target.embed  # type: ignore[attr-defined]  # a tensor, or quantised blocks (native weights)
        # [V_d, d]: only the draft vocabulary's rows (native weights: the same blocks)
        head = self.draft_head(plain_weight(target.lm_head), heads)  # type: ignore[attr-defined]
        return HeadsState(heads, embed, head, None, self.min_prob, rows=len(contexts))


class HeadsState:
    needs_hidden = True  # the decode loop fills `Verified.hidden`

    def __init__(self, heads: SpeculatorHeads, embed: Embedding, head: Weight,
                 hidden: torch.Tensor | None, min_prob: float = 0.0, known: torch.Tensor | None = None,
                 rows: int | None = None) -> None:
        # the batch's rows, also before any hidden state: a state started for rows that join a
        # running batch has none yet, and joining must still count them
        self.rows = rows if rows is not None else (0 if hidden is None else hidden.shape[0])
        self.known = known  # [B] bool: rows whose hidden state is real (None: all of them)
        self.min_prob = min_prob
        self.heads = heads
        self.embed = embed  # [V, d]: the target's (frozen) embedding
        self.head = head  # [V_d, d]: the target's LM head rows of the draft vocabulary (`draft_head`)
        self.hidden = hidden  # [B, d]: target's hidden state at each row's last kept position; None before the first step

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        k = min(max(limits, default=0), self.heads.config.stages)
        device = self.heads.vocab_ids.device
        if k == 0 or self.hidden is None:
            return Draft.from_lists([[] for _ in contexts], device)
        first = torch.as_tensor([c[-1] for c in contexts], dtype=torch.long, device=device)
        tokens, confident = self.heads.draft_confident(self.hidden.float(), first, k, self.embed, self.head, self.min_prob)
        caps = torch.as_tensor([min(limit, k) for limit in limits], dtype=torch.long, device=device)
        lengths = torch.minimum(caps, confident.to(device))
        if self.known is not None:  # rows that joined since the last verification
            lengths = torch.where(self.known.to(device), lengths, torch.zeros_like(lengths))
        ran = min(k, int(confident.max()) + 1)  # stages computed: drafting stops after the last confident one
        charge_rows(ledger, len(contexts), flops=self.heads.flops_per_token() * ran)
        return Draft(tokens=tokens, lengths=lengths)

    def observe(self, verified: Verified) -> None:
        if verified.hidden is None:  # a loop that does not report hidden states: draft nothing
            self.hidden = None
            return
        if verified.hidden.shape[1] == 1:  # a plain step (nothing drafted): a view, no gather (issue 47: every
            self.hidden = verified.hidden[:, 0]  # step of `auto` feeds the heads; the gather was ~45 us of ~7 ms)
        else:
            rows = torch.arange(verified.hidden.shape[0], device=verified.hidden.device)
            # the last kept position (pending + accepted drafts) produced the next pending token
            self.hidden = verified.hidden[rows, verified.accepted.to(verified.hidden.device)]
        self.known = None
        self.rows = self.hidden.shape[0]

    def select(self, rows: Sequence[int]) -> HeadsState:
        hidden = known = None
        if self.hidden is not None:
            index = torch.as_tensor(list(rows), dtype=torch.long, device=self.hidden.device)
            hidden = self.hidden[index]
            known = None if self.known is None else self.known[index]
        return HeadsState(self.heads, self.embed, self.head, hidden, self.min_prob, known, rows=len(rows))

    def join(self, other: DraftState) -> HeadsState:
        """Rows that joined have no target hidden state until their first verification: they
        draft nothing until then (``known``)."""
        assert isinstance(other, HeadsState)
        if self.hidden is None and other.hidden is None:
            return HeadsState(self.heads, self.embed, self.head, None, self.min_prob, rows=self.rows + other.rows)
        like = self.hidden if self.hidden is not None else other.hidden
        assert like is not None
        parts, known = [], []
        for state, n in ((self, self.rows), (other, other.rows)):
            if state.hidden is None:
                parts.append(torch.zeros(n, like.shape[1], dtype=like.dtype, device=like.device))
                known.append(torch.zeros(n, dtype=torch.bool, device=like.device))
            else:
                parts.append(state.hidden)
                known.append(state.known if state.known is not None
                             else torch.ones(n, dtype=torch.bool, device=like.device))
        return HeadsState(self.heads, self.embed, self.head, torch.cat(parts), self.min_prob, torch.cat(known))
