"""Two-stream logit arithmetic: contrastive decoding and classifier-free guidance.

Both run two token streams in lockstep — each with its own KV cache — and decode from a
combination of their next-token log-probabilities:

- **Contrastive decoding** (Li et al. 2023, "Contrastive Decoding: Open-ended Text Generation
  as Optimization", Eq. 2-3): an expert and an amateur model read the same tokens; the score of
  token x is ``log p_exp(x) - log p_ama(x)`` on the plausible head
  ``V_head = {x : p_exp(x) >= alpha * max_w p_exp(w)}`` and ``-inf`` elsewhere. The amateur's
  log-probabilities may be taken at a temperature ``tau`` (``log_softmax(z_ama / tau)``).
- **Classifier-free guidance** for language models (Sanchez et al. 2023, "Stay on topic with
  Classifier-Free Guidance", Eq. 7): one model reads the prompt (conditional stream) and a
  negative prompt — by default only the prompt's last token — (unconditional stream); the
  scores are ``log p_unc + scale * (log p_cond - log p_unc)``, so ``scale = 1`` is plain
  conditional decoding.

`LockstepPair` wraps the two streams as one `LanguageModel` whose logits are these scores, so
the one decode loop (`metaloom.decode.batch`: greedy or any sampler, penalties, constraints,
streaming, rows joining and leaving) runs unchanged on top; its `forward_both` also returns the
primary stream's raw logits, which is what `Completion.logprobs` reports (the decoder's own
scores go to `Completion.decoder_logprobs`). `PairCache` holds the two caches and each row's
parameters, which travel with the row when the cache is forked or joined. Charging: the pair
names both streams (`cost_streams`), so `metaloom.models.forward` charges each model's forward
with its own cache — two forward passes, each with its exact FLOPs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from metaloom.errors import InvalidParameter
from metaloom.models.protocols import KVCache, LanguageModel

if TYPE_CHECKING:
    from metaloom.models.engine.llama import LlamaModel

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _column(params: torch.Tensor, i: int, like: torch.Tensor) -> torch.Tensor:
    """Column i of params [R, k], shaped to broadcast against like [R, ..., V]."""
    return params[:, i].to(like.device).view(-1, *([1] * (like.dim() - 1)))


def contrastive_scores(expert: torch.Tensor, amateur: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Li et al. 2023. expert, amateur: logits [R, ..., V]; params [R, 2] = (alpha, tau).
    Returns scores [R, ..., V] in float32: log p_exp - log p_ama(tau) on V_head, -inf elsewhere."""
    alpha, tau = _column(params, 0, expert), _column(params, 1, expert)
    lp_exp = torch.log_softmax(expert.float(), dim=-1)
    lp_ama = torch.log_softmax(amateur.float() / tau, dim=-1)
    # p >= alpha * max p  <=>  log p >= log alpha + max log p  (alpha = 0 keeps everything)
    head = (lp_exp >= torch.log(alpha) + lp_exp.max(dim=-1, keepdim=True).values) & torch.isfinite(lp_exp)
    return torch.where(head, lp_exp - lp_ama, torch.full_like(lp_exp, float("-inf")))


def guidance_scores(cond: torch.Tensor, uncond: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Sanchez et al. 2023. cond, uncond: logits [R, ..., V]; params [R, 1] = (scale,).
    Returns log p_unc + scale * (log p_cond - log p_unc), float32."""
    scale = _column(params, 0, cond)
    lp_c = torch.log_softmax(cond.float(), dim=-1)
    lp_u = torch.log_softmax(uncond.float(), dim=-1)
    return lp_u + scale * (lp_c - lp_u)


class PairCache:
    """The caches of the two streams plus per-row combine parameters [R, k]. Row b of both
    caches is the same output row; the streams may hold different prompt lengths (guidance),
    so ``lengths`` are the primary's and ``truncate`` rolls both back by the same amounts."""

    def __init__(self, primary: KVCache, secondary: KVCache, params: torch.Tensor) -> None:
        if params.dim() != 2 or params.shape[0] != primary.lengths.shape[0] or secondary.lengths.shape != primary.lengths.shape:
            raise InvalidParameter("params", tuple(params.shape), f"[{primary.lengths.shape[0]}, k] for caches of equal batch")
        self.primary = primary
        self.secondary = secondary
        self.params = params

    @property
    def lengths(self) -> torch.Tensor:
        return self.primary.lengths

    @property
    def capacity(self) -> int:
        return self.primary.capacity

    def fork(self, rows: Sequence[int]) -> PairCache:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return PairCache(self.primary.fork(rows), self.secondary.fork(rows), self.params[index])

    def truncate(self, lengths: Sequence[int] | torch.Tensor) -> None:
        new = torch.as_tensor(lengths, dtype=torch.long, device=self.primary.lengths.device)
        drop = self.primary.lengths - new
        self.primary.truncate(new)
        self.secondary.truncate(self.secondary.lengths - drop.to(self.secondary.lengths.device))

    def join(self, other: KVCache) -> PairCache:
        if not isinstance(other, PairCache) or other.params.shape[1] != self.params.shape[1]:
            raise InvalidParameter("other", type(other).__name__, "a PairCache of the same decoder")
        return PairCache(self.primary.join(other.primary), self.secondary.join(other.secondary),  # type: ignore[attr-defined]
                         torch.cat([self.params, other.params]))

    def release(self) -> None:
        for c in (self.primary, self.secondary):
            release = getattr(c, "release", None)
            if release is not None:
                release()


class LockstepPair:
    """Two models stepped together as one `LanguageModel` whose logits are
    ``combine(primary_logits, secondary_logits, cache.params)``. Holds no state of its own:
    the caches and each row's parameters are in the `PairCache`."""

    def __init__(self, primary: LanguageModel, secondary: LanguageModel, combine: Combine,
                 defaults: Sequence[float]) -> None:
        check_same_vocab(primary, secondary)
        self.primary = primary
        self.secondary = secondary
        self.combine = combine
        self.defaults = torch.tensor(list(defaults), dtype=torch.float32)

    @property
    def vocab_size(self) -> int:
        return self.primary.vocab_size

    @property
    def max_context(self) -> int:
        return min(self.primary.max_context, self.secondary.max_context)

    @property
    def device(self) -> torch.device:
        return self.primary.device

    def new_cache(self, batch: int, capacity: int) -> PairCache:
        return PairCache(self.primary.new_cache(batch, capacity), self.secondary.new_cache(batch, capacity),
                         self.defaults.expand(batch, -1).clone())

    def flops(self, new_tokens: int, attended: int, logit_rows: int) -> float:
        """The primary stream's; `metaloom.models.forward` charges each stream through `cost_streams`."""
        return self.primary.flops(new_tokens, attended, logit_rows)

    def cost_streams(self, cache: KVCache) -> list[tuple[LanguageModel, KVCache]]:
        """(model, its cache) of each stream a forward runs, for exact charging."""
        if not isinstance(cache, PairCache):
            raise InvalidParameter("cache", type(cache).__name__, "a PairCache (from new_cache or prefill_pair)")
        return [(self.primary, cache.primary), (self.secondary, cache.secondary)]

    def forward_both(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                     last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (primary logits, combined scores), each [B, T, V] (or [B, 1, V]);
        both caches advance."""
        if not isinstance(cache, PairCache):
            raise InvalidParameter("cache", type(cache).__name__, "a PairCache (from new_cache or prefill_pair)")
        first = self.primary.forward(tokens, cache.primary, valid=valid, last_only=last_only)
        second = self.secondary.forward(tokens, cache.secondary, valid=valid, last_only=last_only)
        return first, self.combine(first, second, cache.params)

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> combined scores [B, T, V] (or [B, 1, V]); both caches advance."""
        return self.forward_both(tokens, cache, valid=valid, last_only=last_only)[1]


def check_same_vocab(expert: LanguageModel, amateur: LanguageModel) -> None:
    """The two streams must share a vocabulary (same tokenizer); only its size is checkable."""
    if amateur.vocab_size != expert.vocab_size:
        raise InvalidParameter("amateur vocab_size", amateur.vocab_size,
                               f"{expert.vocab_size} (the expert's): both models must share one tokenizer")


def truncated_llama(model: object, layers: int) -> LlamaModel:
    """An amateur for contrastive decoding made from a native `LlamaModel`: its first
    ``layers`` layers, then its final norm and LM head (early exit). Shares every tensor with
    ``model`` — no extra weight memory."""
    from metaloom.models.engine.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        raise InvalidParameter("amateur_model", type(model).__name__,
                               "a truncation of a native Llama-family model (backend native)")
    total = model.config.num_hidden_layers
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= total:
        raise InvalidParameter("amateur layers", layers, f"an integer in [1, {total}]")
    config = dataclasses.replace(model.config, num_hidden_layers=layers)
    return LlamaModel(config, model.embed, model.layers[:layers], model.norm, model.lm_head, model.fused, model.options)
