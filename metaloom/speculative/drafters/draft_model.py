"""A smaller model with the same tokenizer drafts autoregressively (Leviathan et al. 2023;
Chen et al. 2023). Also the engine of the quantised self-draft (`quantized.py`), whose draft
model is the target itself with low-precision weights.

The draft model keeps its own KV cache. Each `propose` first feeds it the context tokens it
has not seen (the previous step's kept tokens and the pending token: one forward, rows
right-padded), then draws one token per forward. Tokens it fed that the target rejected are
dropped from its cache by `KVCache.truncate` at the next `propose`, found by comparing what it
fed with the row's context.

Greedy rows draft the argmax; sampled rows draw from q = the draft's logits through a plain
pipeline with the row's temperature and truncation (top-k/top-p/min-p; no penalties or
stateful adapters), by inverse CDF at the very uniform plain sampling uses for the position the
drafted token would take (`metaloom.sampling.counter`): the target accepts it when its own draw
there lands on the same token (`metaloom.speculative.core`), which is likeliest when both draw at
one uniform. They report q (Draft.probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from metaloom.errors import UnsupportedModel
from metaloom.models.forward import Ledgers, charged_forward
from metaloom.models.kernels import draw as c_draw
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.sampling.counter import uniforms
from metaloom.sampling.params import SamplingParams
from metaloom.sampling.pipeline import Sampler, make_sampler
from metaloom.speculative.cost import measure_verify_cost
from metaloom.speculative.drafter import MAX_DRAFT, Draft, DraftState, Verified

FEED_TOKENS = 16  # the forward width `DraftModelDrafter.measure_feed` times


@dataclass(frozen=True)
class DraftModelDrafter:
    """``model``: any `LanguageModel` whose token ids mean what the target's mean (the same
    tokenizer; the embedding may be padded to a different size, see `DraftModelState._fit`)."""

    model: LanguageModel
    name: str = "draft"
    feed: list[float] = field(default_factory=list, compare=False, repr=False)  # `measure_feed`'s, once

    def measure_feed(self) -> float:
        """Seconds a context token costs this model when fed `FEED_TOKENS` at a time (the cost
        model prices a catch-up with it, `DraftModelState.catch_up`); measured on first use, as
        the target's verify cost is."""
        if not self.feed:
            cost = measure_verify_cost(self.model, most=FEED_TOKENS, context=FEED_TOKENS, repeats=2, only=True)
            self.feed.append(cost.seconds_for(FEED_TOKENS) / FEED_TOKENS)
        return self.feed[0]

    def start(self, target: LanguageModel, sampler: Sampler, contexts: Sequence[Sequence[int]],
              keys: Sequence[int]) -> DraftModelState:
        longest = max((len(c) for c in contexts), default=0)
        room = min(self.model.max_context, longest + _max_new(sampler) + 2 * MAX_DRAFT + 2)
        cache = self.model.new_cache(len(contexts), room)
        q_params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
                    for p in sampler.params]
        q_sampler = make_sampler(q_params, target.vocab_size, self.model.device)
        ends = ([len(c) + p.max_tokens for c, p in zip(contexts, sampler.params, strict=True)]
                if len(sampler.params) == len(contexts) else None)  # one set of parameters a row, as the loop's
        return DraftModelState(self.model, cache, [[] for _ in contexts], q_sampler, target.vocab_size, keys,
                               [len(c) for c in contexts], self.feed[0] if self.feed else 0.0, ends)


def _max_new(sampler: Sampler) -> int:
    return max((p.max_tokens for p in sampler.params), default=0)


class DraftModelState:
    def __init__(self, model: LanguageModel, cache: KVCache, fed: list[list[int]], q_sampler: Sampler,
                 target_vocab: int, keys: Sequence[int], starts: Sequence[int], feed: float = 0.0,
                 ends: Sequence[int] | None = None) -> None:
        self.model = model
        self.cache = cache
        self.fed = fed  # fed[b]: the tokens in the draft cache of row b
        self.checked = [0] * len(fed)  # fed[b][:checked[b]] is known to equal row b's context
        self.q_sampler = q_sampler
        self.vocab = target_vocab
        self.keys = list(keys)  # the rows' random keys: a seeded request stays reproducible
        self.starts = list(starts)  # each row's prompt length: its context position - start is the output's
        self.feed = feed  # seconds a context token costs to feed (`DraftModelDrafter.measure_feed`; 0: not measured)
        self.ends = None if ends is None else list(ends)  # each row's context length at its max_tokens (None: unknown)

    def catch_up(self, contexts: Sequence[Sequence[int]]) -> float:
        """Seconds of feeding the context it has not seen before it can draft (at its first
        proposal, the whole prompt): the cost model prices this before trying it."""
        return self.feed * sum(max(len(c) - len(f), 0) for c, f in zip(contexts, self.fed, strict=True))

    def ahead(self, contexts: Sequence[Sequence[int]]) -> int | None:
        """The most tokens a row may still produce (its max_tokens; None: unknown): what a
        catch-up would be spread over (the cost model weighs the one against the other)."""
        if self.ends is None:
            return None
        return max((e - len(c) for e, c in zip(self.ends, contexts, strict=True)), default=0)

    def _sync(self, contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        """Roll each row's cache back to the longest prefix shared with its context; return
        the context tokens still to feed (at least the last, pending, token)."""
        keep = []
        for fed, context, checked in zip(self.fed, contexts, self.checked, strict=True):
            limit = min(len(fed), len(context) - 1)
            n = limit
            for i in range(min(checked, limit), limit):  # before `checked` both are the verified context
                if fed[i] != context[i]:
                    n = i
                    break
            keep.append(n)
        self.cache.truncate(torch.as_tensor(keep, dtype=torch.long, device=self.cache.lengths.device))
        for b, n in enumerate(keep):
            del self.fed[b][n:]
        self.checked = [len(c) for c in contexts]
        return [list(c[n:]) for c, n in zip(contexts, keep, strict=True)]

    def propose(self, contexts: Sequence[Sequence[int]], limits: Sequence[int], ledger: Ledgers) -> Draft:
        b = len(contexts)
        k = max(limits, default=0)
        if k == 0:
            return Draft.from_lists([[] for _ in contexts], self.model.device)
        todo = self._sync(contexts)
        device = self.model.device
        width = max(len(t) for t in todo)
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        for i, t in enumerate(todo):
            tokens[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
        valid = torch.tensor([len(t) for t in todo], dtype=torch.long, device=device)
        for i, t in enumerate(todo):
            self.fed[i].extend(t)
        drafted = torch.zeros(b, k, dtype=torch.long, device=device)
        sampled = [row for row, p in enumerate(self.q_sampler.params) if not p.greedy]
        probs = torch.zeros(b, k, self.vocab, device=device) if sampled else None
        logits = charged_forward(self.model, tokens, self.cache, ledger, valid=valid, last_only=True)[:, -1]
        for j in range(k):
            if probs is None:  # all greedy: the argmax is all a greedy row needs
                token = c_draw.row_max(self._fit(logits))[1]
            else:
                lq = self.q_sampler.process(self._fit(logits))  # [B, V]
                probs[:, j] = lq.exp()
                token = self.q_sampler.draw(lq, self._uniforms(contexts, j, device), search=c_draw.search)
            drafted[:, j] = token
            if j == k - 1:
                break
            logits = charged_forward(self.model, token[:, None], self.cache, ledger)[:, -1]
            for i in range(b):
                self.fed[i].append(int(token[i]))
        lengths = torch.as_tensor(list(limits), dtype=torch.long, device=device)
        return Draft(tokens=drafted, lengths=lengths, probs=probs)

    def _uniforms(self, contexts: Sequence[Sequence[int]], j: int, device: torch.device) -> torch.Tensor:
        """[B] the uniforms of the j-th drafted tokens: plain sampling's at each row's key and the
        output position that token would take (its context position less the prompt's length;
        computed on the host, no device wait)."""
        keys = np.asarray(self.keys, dtype=np.int64)
        at = np.asarray([len(c) + j - start for c, start in zip(contexts, self.starts, strict=True)], dtype=np.int64)
        return torch.from_numpy(uniforms(keys, at)).to(device)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (ids past the draft's own are impossible)."""
        v = logits.shape[-1]
        if v == self.vocab:
            return logits
        if v > self.vocab:
            return logits[:, :self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - v), value=float("-inf"))

    def observe(self, verified: Verified) -> None:
        pass

    def select(self, rows: Sequence[int]) -> DraftModelState:
        index = list(rows)
        state = DraftModelState(self.model, self.cache.fork(index), [list(self.fed[r]) for r in index],
                                self.q_sampler.select(index), self.vocab, [self.keys[r] for r in index],
                                [self.starts[r] for r in index], self.feed,
                                None if self.ends is None else [self.ends[r] for r in index])
        state.checked = [self.checked[r] for r in index]
        release = getattr(self.cache, "release", None)
        if release is not None:
            release()  # this state is replaced by the selection
        return state

    def join(self, other: DraftState) -> DraftModelState:
        assert isinstance(other, DraftModelState)
        joined = getattr(self.cache, "join", None)
        if joined is None:
            raise UnsupportedModel(f"{type(self.cache).__name__} cannot take rows into a running batch (no join)")
        state = DraftModelState(self.model, joined(other.cache), self.fed + other.fed, self.q_sampler.join(other.q_sampler),
                                self.vocab, self.keys + other.keys, self.starts + other.starts, self.feed,
                                None if self.ends is None or other.ends is None else self.ends + other.ends)
        state.checked = self.checked + other.checked
        return state
