"""Truncation: pure batched functions that remove tokens (set their logit to -inf).

Steps 5-7 of the pipeline (`metaloom.sampling.pipeline`). Each takes logits [B, V] (float32,
possibly holding -inf from earlier steps) and per-row parameters [B], and returns new logits;
inputs are never mutated and a disabled row comes back unchanged. Probabilities are those of
the logits as given (after temperature and the earlier truncations, renormalised), as when
transformers chains its warpers. Every adapter here except typical and XTC always keeps the
most likely token (argmax-invariant).

One sort for the steps that rank by probability. Top-H, top-k, top-p and min-p each keep a
prefix of the tokens sorted by probability, so each has a form on logits already sorted in
descending order (``*_sorted``: it removes a suffix, and what it leaves is still sorted for the
next one). `truncate` runs the stage-5 steps in order and, where consecutive enabled steps have
that form and one of them sorts anyway (top-H, top-p), sorts once, runs them all on the sorted
logits and puts the result back in vocabulary order once (as vLLM's sampler does for top-k and
top-p). The sort is stable, and each standalone function (``top_p`` ...) is its sorted form
between a stable sort and the scatter back, so the shared sort gives the same tensor bit for
bit as the steps one at a time; top-k and min-p compare values elementwise (the k-th largest
logit; exp(logit - max) against p), which no order changes. Typical ranks tokens by another
key (the distance of their surprise from the entropy) and keeps its own sort; epsilon and eta
need no order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of softmax(logits) per row: [B, V] -> [B]; -inf entries count 0."""
    return torch.special.entr(torch.softmax(logits, dim=-1)).sum(-1)


def _below_top(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: tokens strictly below the row's maximum (removable without losing the argmax)."""
    return logits < logits.max(dim=-1, keepdim=True).values


def _unsort(sorted_mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(sorted_mask).scatter(-1, order, sorted_mask)


def sort_desc(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, order): the row sorted in descending order, ties in vocabulary order (stable, so
    every step sorting the same values agrees on them)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True)


def _on_sorted(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor,
               param: torch.Tensor) -> torch.Tensor:
    """A sorted form applied to logits in vocabulary order: sort, apply, scatter back."""
    values, order = sort_desc(logits)
    return _unsort(fn(values, param), order)


def top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Top-nσ (Tang et al. 2024, "Top-nσ: Not All Logits Are You Need"): keep tokens whose
    logit is at least max - n·σ, σ the (population) standard deviation of the row's finite
    logits. The kept set does not depend on temperature. n = 0 disables."""
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(finite, logits, 0.0).sum(-1, keepdim=True) / count
    var = torch.where(finite, (logits - mean) ** 2, 0.0).sum(-1, keepdim=True) / count
    threshold = logits.max(dim=-1, keepdim=True).values - n[:, None] * var.sqrt()
    threshold = torch.where(n[:, None] > 0, threshold, torch.full_like(threshold, NEG_INF))
    return logits.masked_fill(logits < threshold, NEG_INF)


def top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept, as in
    transformers); k = 0 keeps all."""
    vocab = logits.shape[-1]
    k_eff = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    kth = torch.topk(logits, int(k_eff.max()), dim=-1).values.gather(-1, (k_eff - 1)[:, None])
    return logits.masked_fill(logits < kth, NEG_INF)


def top_k_sorted(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`top_k` on logits sorted in descending order (the k-th largest is at position k - 1)."""
    vocab = values.shape[-1]
    k_eff = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    return values.masked_fill(values < values.gather(-1, (k_eff - 1)[:, None]), NEG_INF)


def top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability sum reaches p; the most likely token is always kept."""
    return _on_sorted(top_p_sorted, logits, p)


def top_p_sorted(values: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`top_p` on logits sorted in descending order."""
    probs = torch.softmax(values, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    remove = (before >= p[:, None]) & (p < 1)[:, None]  # p = 1 keeps all, whatever the rounding
    remove[:, 0] = False
    return values.masked_fill(remove, NEG_INF)


def min_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Min-p (Nguyen et al. 2024): drop tokens whose probability is below p times the top
    token's probability. The ratio of two probabilities is exp(logit - max logit): no softmax,
    and the same in any order of the vocabulary."""
    ratio = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    return logits.masked_fill(ratio < p[:, None], NEG_INF)


min_p_sorted = min_p  # elementwise against the row's maximum: the same on sorted logits


def typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2023): rank tokens by how close their surprise
    -log p is to the entropy, and keep the closest ones until their probability reaches
    ``mass`` (the token that crosses it is kept, as in transformers). mass = 1 disables. May
    remove the most likely token."""
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp * logp.exp()).nansum(-1, keepdim=True)
    distance, order = torch.sort((-logp - ent).abs(), dim=-1)
    cum = torch.softmax(logits.gather(-1, order), dim=-1).cumsum(-1)
    last = (cum < mass[:, None]).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove_sorted = distance > distance.gather(-1, last)
    remove_sorted[:, 0] = False
    out = logits.masked_fill(_unsort(remove_sorted, order), NEG_INF)
    return torch.where((mass < 1)[:, None], out, logits)


def epsilon(logits: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Epsilon sampling (Hewitt et al. 2022, "Truncation Sampling as Language Model
    Desmoothing"): drop tokens with probability below eps, never the most likely. 0 disables."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill((probs < eps[:, None]) & _below_top(logits), NEG_INF)


def eta(logits: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Eta sampling (Hewitt et al. 2022): like epsilon with an entropy-dependent threshold
    eta = min(eps, sqrt(eps) * exp(-H)), H the entropy in nats. 0 disables."""
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.minimum(eps, eps.sqrt() * torch.exp(-entropy(logits)))
    return logits.masked_fill((probs < threshold[:, None]) & _below_top(logits), NEG_INF)


def top_h(logits: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Top-H (Potraghloo et al. 2025, "Top-H Decoding: Adapting the Creativity and Coherence
    with Bounded Entropy in Text Generation"), the greedy rule of the authors' code and of
    transformers' `TopHLogitsWarper`: add tokens from most to least likely while the sum of
    their entropy terms -p log p stays within alpha * H(p); the most likely token is always kept.
    transformers scans only the 100 most likely tokens (a speed cap that also renormalises p
    over them); here the whole vocabulary counts, so the two agree when V <= 100. 0 disables."""
    return _on_sorted(top_h_sorted, logits, alpha)


def top_h_sorted(values: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """`top_h` on logits sorted in descending order."""
    terms = torch.special.entr(torch.softmax(values, dim=-1))
    cum = terms.cumsum(-1)
    keep = cum <= alpha[:, None] * cum[:, -1:]  # cum[-1] = H(p); alpha 1 keeps every token
    keep[:, 0] = True
    return torch.where((alpha > 0)[:, None], values.masked_fill(~keep, NEG_INF), values)


def xtc(logits: torch.Tensor, threshold: torch.Tensor, apply: torch.Tensor) -> torch.Tensor:
    """XTC, "exclude top choices" (p-e-w, text-generation-webui PR 6335; also llama.cpp): in rows
    where ``apply`` [B] bool is set (the caller's coin, heads with probability xtc_probability),
    if at least two tokens have probability >= threshold, remove all of them except the least
    likely. Tokens tied at that lowest probability are all kept (llama.cpp keeps one of them,
    chosen by its sort order)."""
    probs = torch.softmax(logits, dim=-1)
    above = probs >= threshold[:, None]
    lowest = torch.where(above, probs, torch.ones_like(probs)).min(dim=-1, keepdim=True).values
    acts = apply & (above.sum(-1) >= 2)
    return logits.masked_fill(above & (probs > lowest) & acts[:, None], NEG_INF)


def mirostat(logits: torch.Tensor, mu: torch.Tensor, enabled: torch.Tensor) -> torch.Tensor:
    """Mirostat v2 truncation (Basu et al. 2021, "Mirostat: A Neural Text Decoding Algorithm
    that Directly Controls Perplexity", as in llama.cpp): remove tokens whose surprise -log2 p
    exceeds the row's bound ``mu`` [B] (bits), never the most likely. enabled [B] bool. After
    the draw the caller moves mu toward the target (`mirostat_update`)."""
    surprise = -torch.log_softmax(logits, dim=-1) / math.log(2)
    remove = (surprise > mu[:, None]) & _below_top(logits) & enabled[:, None]
    return logits.masked_fill(remove, NEG_INF)


def mirostat_update(mu: torch.Tensor, logprob: torch.Tensor, tau: torch.Tensor, eta_: torch.Tensor) -> torch.Tensor:
    """mu - eta * (observed surprise - tau), the surprise -log2 p of the drawn token under the
    final (truncated, renormalised) distribution. All [B]."""
    return mu - eta_ * (-logprob / math.log(2) - tau)


Truncate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Step:
    """One truncation step of stage 5: the `SamplingParams` field it reads (its knob names the
    adapter), the function on logits in vocabulary order, and, for a step that keeps a prefix
    of the tokens ranked by probability, its form on logits sorted in descending order
    (``sorts``: the function sorts by itself, so a shared sort saves one)."""

    field: str
    apply: Truncate
    on_sorted: Truncate | None = None
    sorts: bool = False


# stage 5 in order (`metaloom.sampling.pipeline`): top-nσ and top-H look at the whole
# distribution; from top-H on this is transformers' warper order
STEPS: tuple[Step, ...] = (
    Step("top_n_sigma", top_n_sigma),
    Step("top_h", top_h, top_h_sorted, sorts=True),
    Step("top_k", top_k, top_k_sorted),
    Step("top_p", top_p, top_p_sorted, sorts=True),
    Step("min_p", min_p, min_p_sorted),
    Step("typical_p", typical),
    Step("epsilon_cutoff", epsilon),
    Step("eta_cutoff", eta),
)


def truncate(logits: torch.Tensor, steps: Sequence[tuple[Step, torch.Tensor]]) -> torch.Tensor:
    """Run ``steps`` (each with its per-row parameter [B]) in order on logits [B, V]. A run of
    consecutive steps with a sorted form shares one sort when one of them sorts anyway (a run
    of top-k and min-p alone needs no sort at all: top-k takes `torch.topk`)."""
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and steps[j][0].on_sorted is not None:
            j += 1
        run = steps[i:j]
        if any(step.sorts for step, _ in run):
            values, order = sort_desc(logits)
            for step, param in run:
                assert step.on_sorted is not None
                values = step.on_sorted(values, param)
            logits = torch.empty_like(values).scatter_(-1, order, values)
            i = j
            continue
        step, param = steps[i]
        logits = step.apply(logits, param)
        i += 1
    return logits
