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
the ordinary decode loop (greedy or any sampler, penalties, constraints, streaming, row
compaction) runs unchanged on top; `PairCache` holds the two caches and each row's parameters,
which travel with the row when the cache is forked. The secondary stream's forward is charged
by `charged_forward` inside `LockstepPair.forward`; the primary's by the caller's
`charged_forward` (the pair reports the primary model's FLOPs), so every model call is
charged once with its own exact FLOPs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from metaloom.decode.forward import charged_forward
from metaloom.decode.loop import prefill
from metaloom.errors import InvalidParameter
from metaloom.ledger import Ledger
from metaloom.models.protocols import KVCache, LanguageModel

if TYPE_CHECKING:
    from metaloom.models.llama import LlamaModel

Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _finite(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidParameter(name, value, "a finite number")
    return float(value)


@dataclass(frozen=True)
class ContrastiveParams:
    """``alpha``: plausibility cut in [0, 1] (0 keeps every token; Li et al. use 0.1);
    ``amateur_temperature``: tau > 0 applied to the amateur's logits."""

    alpha: float = 0.1
    amateur_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= _finite("alpha", self.alpha) <= 1.0:
            raise InvalidParameter("alpha", self.alpha, "in [0, 1]")
        if _finite("amateur_temperature", self.amateur_temperature) <= 0:
            raise InvalidParameter("amateur_temperature", self.amateur_temperature, "> 0")

    def row(self) -> tuple[float, ...]:
        return (self.alpha, self.amateur_temperature)


@dataclass(frozen=True)
class GuidanceParams:
    """``scale``: guidance strength gamma >= 0 (1 = conditional, 0 = unconditional; Sanchez et
    al. use 1.5); ``negative_prompt``: the unconditional stream's prompt, encoded like the
    request's prompt (text, or chat messages); None: the prompt's last token alone."""

    scale: float = 1.5
    negative_prompt: str | tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if _finite("cfg_scale", self.scale) < 0:
            raise InvalidParameter("cfg_scale", self.scale, ">= 0")
        if self.negative_prompt is not None and not self.negative_prompt:
            raise InvalidParameter("negative_prompt", self.negative_prompt, "non-empty text or messages, or None")

    def row(self) -> tuple[float, ...]:
        return (self.scale,)


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


class LockstepPair:
    """Two models stepped together as one `LanguageModel` whose logits are
    ``combine(primary_logits, secondary_logits, cache.params)``.

    ``ledger`` is the ledger of the current call (the pair is built per call): the secondary
    stream's forwards are charged to it here; the primary's are charged by whoever calls
    `charged_forward` on the pair (``flops`` reports the primary model's)."""

    def __init__(self, primary: LanguageModel, secondary: LanguageModel, combine: Combine, ledger: Ledger,
                 defaults: Sequence[float]) -> None:
        check_same_vocab(primary, secondary)
        self.primary = primary
        self.secondary = secondary
        self.combine = combine
        self.ledger = ledger
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
        return self.primary.flops(new_tokens, attended, logit_rows)

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> combined scores [B, T, V] (or [B, 1, V]); both caches advance."""
        if not isinstance(cache, PairCache):
            raise InvalidParameter("cache", type(cache).__name__, "a PairCache (from new_cache or prefill_pair)")
        first = self.primary.forward(tokens, cache.primary, valid=valid, last_only=last_only)
        second = charged_forward(self.secondary, tokens, cache.secondary, self.ledger, valid=valid, last_only=last_only)
        return self.combine(first, second, cache.params)


def check_same_vocab(expert: LanguageModel, amateur: LanguageModel) -> None:
    """The two streams must share a vocabulary (same tokenizer); only its size is checkable."""
    if amateur.vocab_size != expert.vocab_size:
        raise InvalidParameter("amateur vocab_size", amateur.vocab_size,
                               f"{expert.vocab_size} (the expert's): both models must share one tokenizer")


def prefill_pair(primary: LanguageModel, secondary: LanguageModel, prompts: Sequence[Sequence[int]],
                 secondary_prompts: Sequence[Sequence[int]], capacities: tuple[int, int], params: torch.Tensor,
                 combine: Combine, ledger: Ledger) -> tuple[LockstepPair, PairCache, torch.Tensor]:
    """Prefill both streams (each its own prompts and cache capacity). params [B, k] are the
    rows' combine parameters. Returns (pair, cache, combined scores [B, V])."""
    pair = LockstepPair(primary, secondary, combine, ledger, params[0].tolist() if len(params) else ())
    first_cache, first = prefill(primary, prompts, capacities[0], ledger)
    second_cache, second = prefill(secondary, secondary_prompts, capacities[1], ledger)
    return pair, PairCache(first_cache, second_cache, params), combine(first, second, params)


def truncated_llama(model: object, layers: int) -> LlamaModel:
    """An amateur for contrastive decoding made from a native `LlamaModel`: its first
    ``layers`` layers, then its final norm and LM head (early exit). Shares every tensor with
    ``model`` — no extra weight memory."""
    from metaloom.models.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        raise InvalidParameter("amateur_model", type(model).__name__,
                               "a truncation of a native Llama-family model (backend native)")
    total = model.config.num_hidden_layers
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= total:
        raise InvalidParameter("amateur layers", layers, f"an integer in [1, {total}]")
    config = dataclasses.replace(model.config, num_hidden_layers=layers)
    return LlamaModel(config, model.embed, model.layers[:layers], model.norm, model.lm_head, model.fused)
