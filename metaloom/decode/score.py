"""Scoring: the log-probability a model gives to continuations of a prompt.

The prompt is prefilled once; its cache is forked once per continuation of a batch and the
continuations, right-padded (``valid``), go through **one** forward per batch. Token ``j`` of a
continuation is scored by the logits after token ``j - 1`` (the prompt's last logits for
``j = 0``). Used by choice selection, minimum-Bayes-risk decoding and reward-free best-of-N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metaloom.decode.memory import charge_peak, held_bytes
from metaloom.decode.prefill import new_cache, prefill, prefill_cached, release_cache
from metaloom.errors import ContextWindowExceeded, InvalidParameter
from metaloom.ledger import Ledger
from metaloom.models.engine.pool import KVPool
from metaloom.models.forward import charged_forward
from metaloom.models.protocols import KVCache, LanguageModel, Tokenizer
from metaloom.prefix.pool import PrefixCache
from metaloom.prefix.radix import common_prefix


@dataclass(frozen=True)
class ContinuationScore:
    """``logprobs[j]`` = log p(tokens[j] | prompt, tokens[:j]) under the raw model."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str = ""

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def mean_logprob(self) -> float:
        return self.logprob / len(self.logprobs)


def score_continuations(model: LanguageModel, prompt: Sequence[int], continuations: Sequence[Sequence[int]],
                        ledger: Ledger, *, batch_size: int = 16, pool: KVPool | None = None,
                        prefix_cache: PrefixCache | None = None) -> list[ContinuationScore]:
    """Per-token log-probabilities of each continuation (token ids) after ``prompt``.

    Charges the prompt once and every continuation token as input tokens; one forward for the
    prompt plus one per batch of ``batch_size`` continuations. The batch's rows fork the
    prompt's cache row (with the native model's KV pool, ``pool``, without copying it).
    With a ``prefix_cache`` (bound to ``pool``) the prompt starts from its longest cached prefix
    (charged as ``cached_tokens``, no FLOPs) and is stored for later calls: an LLM judge asks
    about many paths of one problem, and their questions share the problem and most of the path.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidParameter("batch_size", batch_size, "an integer >= 1")
    if not prompt:
        raise InvalidParameter("prompt", list(prompt), "at least one token (the first continuation token needs a context)")
    for i, c in enumerate(continuations):
        if not c:
            raise InvalidParameter(f"continuations[{i}]", list(c), "at least one token")
    if not continuations:
        return []
    longest = max(len(c) for c in continuations)
    if len(prompt) + longest > model.max_context:
        raise ContextWindowExceeded(len(prompt) + longest, model.max_context, "prompt plus the longest continuation")
    ledger.charge(input_tokens=len(prompt) + sum(len(c) for c in continuations))
    if prefix_cache is not None and pool is not None:
        cache, last = prefill_cached(model, [list(prompt)], len(prompt) + longest, ledger, prefix_cache, pool=pool)
    else:
        cache, last = prefill(model, [list(prompt)], len(prompt) + longest, ledger, pool=pool)
    first = torch.log_softmax(last[0].float(), dim=-1)  # [V]: scores each continuation's first token
    out: list[ContinuationScore] = []
    high = -1
    for start in range(0, len(continuations), batch_size):
        batch = [list(c) for c in continuations[start:start + batch_size]]
        width = max(len(c) for c in batch)
        tokens = torch.zeros(len(batch), width, dtype=torch.long, device=model.device)
        for i, c in enumerate(batch):
            tokens[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
        valid = torch.tensor([len(c) for c in batch], dtype=torch.long, device=model.device)
        # the last token's logits are not needed, but dropping it would leave 1-token rows empty
        rows = cache.fork([0] * len(batch))
        logits = charged_forward(model, tokens, rows, ledger, valid=valid)
        # the batch's rows hold the prompt's slots (once) and every continuation token's
        held = held_bytes(rows)
        if held is None or held > high:
            high = held if held is not None else high
            charge_peak(ledger, held)
        release_cache(rows)
        lp = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
        for i, c in enumerate(batch):
            later = lp[i, torch.arange(len(c) - 1), tokens[i, 1:len(c)]] if len(c) > 1 else lp.new_zeros(0)
            values = [float(first[c[0]]), *later.tolist()]
            out.append(ContinuationScore(tuple(c), tuple(values)))
    release_cache(cache)
    return out


@dataclass(frozen=True)
class PromptPosition:
    """One prompt token as the model saw it: ``logprob`` = log p(token | the tokens before it),
    ``rank`` its 1-based rank in that distribution, ``top`` the ``k`` most likely tokens there
    as (id, log-probability) pairs, most likely first."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def prompt_logprobs(model: LanguageModel, prompt: Sequence[int], k: int, ledger: Ledger, *, chunk: int = 256,
                    pool: KVPool | None = None, count_input: bool = True) -> list[PromptPosition]:
    """Log-probabilities of every prompt token after the ones before it (the first token has no
    context, so positions start at token 1): what OpenAI's ``echo`` with ``logprobs`` and vLLM's
    ``prompt_logprobs`` report. The prompt runs through the cache ``chunk`` tokens at a time, so
    the full [T, V] logits never exist at once. Charges the forwards, and the prompt as input
    tokens unless ``count_input`` is False (a generation that reads the same prompt counts it)."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidParameter("k", k, "an integer >= 0")
    if len(prompt) > model.max_context:
        raise ContextWindowExceeded(len(prompt), model.max_context, "the prompt")
    if count_input:
        ledger.charge(input_tokens=len(prompt))
    if len(prompt) < 2:
        return []
    cache = new_cache(model, 1, len(prompt), pool)
    try:
        return _positions(model, list(prompt), 0, k, cache, ledger, chunk)
    finally:
        release_cache(cache)


def shared_prompt_logprobs(model: LanguageModel, prompts: Sequence[Sequence[int]], k: int, ledger: Ledger, *,
                           chunk: int = 256, pool: KVPool | None = None,
                           count_input: bool = True) -> list[list[PromptPosition]]:
    """`prompt_logprobs` of several prompts, each beginning they share computed once (a judge's
    question asked with "Yes" and with "No", the questions about one candidate set). The
    prompts go in sorted order, each after the one before it: the positions they share are
    copied (position ``t`` depends only on tokens ``0..t``) and its cache, cut to the shared
    beginning less one token, is forked (the last shared token is run again, since its
    distribution was not kept). Charges each prompt as input tokens (unless ``count_input`` is
    False) with what it did not compute as cached tokens, and the forwards actually run."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise InvalidParameter("k", k, "an integer >= 0")
    for p in prompts:
        if len(p) > model.max_context:
            raise ContextWindowExceeded(len(p), model.max_context, "the prompt")
    out: list[list[PromptPosition]] = [[] for _ in prompts]
    if not prompts:
        return out
    capacity = max(max(len(p) for p in prompts), 1)
    previous: list[int] = []
    out_previous: list[PromptPosition] = []
    cache: KVCache | None = None
    try:
        for i in sorted(range(len(prompts)), key=lambda i: list(prompts[i])):
            ids = list(prompts[i])
            # a cache that dropped positions (--kv-policy) cannot be cut back to a shared prefix
            shared = 0 if getattr(cache, "drops", False) else common_prefix(previous, ids)
            keep = max(min(shared, len(ids)) - 1, 0)  # positions (and KV entries) taken from the one before
            out[i] = out_previous[:keep] if keep else []
            if count_input:
                ledger.charge(input_tokens=len(ids), cached_tokens=keep)
            if keep >= len(ids) - 1:  # nothing new to compute (the same prompt again, or a 1-token one)
                continue
            forked = new_cache(model, 1, capacity, pool) if cache is None or keep == 0 else cache.fork([0])
            if keep:
                forked.truncate([keep])
            release_cache(cache)
            cache, previous, out_previous = forked, ids, out[i]
            out[i].extend(_positions(model, ids, keep, k, cache, ledger, chunk))
    finally:
        release_cache(cache)
    return out


def _positions(model: LanguageModel, prompt: list[int], start: int, k: int, cache: KVCache, ledger: Ledger,
               chunk: int) -> list[PromptPosition]:
    """Positions ``start + 1 ..`` of ``prompt``, from a ``cache`` holding its first ``start`` tokens."""
    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device)
    out: list[PromptPosition] = []
    for begin in range(start, len(prompt) - 1, chunk):  # the last token's logits score nothing
        piece = ids[begin:min(begin + chunk, len(prompt) - 1)]
        lp = torch.log_softmax(charged_forward(model, piece[None], cache, ledger)[0].float(), dim=-1)  # [t, V]
        charge_peak(ledger, held_bytes(cache))  # one row, growing a chunk at a time: the last chunk is its peak
        nxt = ids[begin + 1:begin + 1 + len(piece)]
        chosen = lp.gather(-1, nxt[:, None])[:, 0]
        ranks = (lp > chosen[:, None]).sum(-1) + 1
        values, top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        for token, value, rank, t_ids, t_values in zip(nxt.tolist(), chosen.tolist(), ranks.tolist(), top.tolist(),
                                                       values.tolist(), strict=True):
            out.append(PromptPosition(token, value, rank, tuple(zip(t_ids, t_values, strict=True))))
    return out


def split_continuation(tokenizer: Tokenizer, context: str, continuation: str, *,
                       add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as the tokenizer would cut ``context + continuation``:
    the continuation's ids are what the whole text has after the context's ids (as
    lm-evaluation-harness does), or its own encoding when a token crosses the boundary."""
    ctx = tokenizer.encode(context, add_special_tokens=add_special_tokens)
    whole = tokenizer.encode(context + continuation, add_special_tokens=add_special_tokens)
    if whole[:len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx):]
    return ctx, tokenizer.encode(continuation, add_special_tokens=False)


def score_texts(model: LanguageModel, tokenizer: Tokenizer, context: str, continuations: Sequence[str], ledger: Ledger, *,
                add_special_tokens: bool = True, batch_size: int = 16) -> list[ContinuationScore]:
    """`score_continuations` on text: ``context`` is the full prompt text (already through a
    chat template if one is wanted; then pass ``add_special_tokens=False``)."""
    for i, text in enumerate(continuations):
        if not isinstance(text, str) or not text:
            raise InvalidParameter(f"continuations[{i}]", text, "non-empty text")
    if not continuations:
        return []
    prompt: list[int] = []
    ids = []
    for text in continuations:
        prompt, cont = split_continuation(tokenizer, context, text, add_special_tokens=add_special_tokens)
        if not cont:
            raise InvalidParameter("continuation", text, "text that encodes to at least one token")
        ids.append(cont)
    scores = score_continuations(model, prompt, ids, ledger, batch_size=batch_size)
    return [ContinuationScore(s.tokens, s.logprobs, text) for s, text in zip(scores, continuations, strict=True)]
