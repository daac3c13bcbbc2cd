"""The logits pipeline: one documented order, written once, used by every decoder.

Order (each step is a pure batched function in `processors.py`):

1. penalties: repetition (prompt + output), presence and frequency (output)
2. logit bias
3. constraint mask (issue: constrained decoding; applied by the caller's cursor, see `apply`)
4. temperature (rows with temperature 0 are greedy and skip steps 4-5)
5. truncation: top-k -> top-p -> min-p
6. draw: argmax for greedy rows, otherwise a categorical draw with the row's `torch.Generator`

`Sampler.process` returns the final log-probabilities the draw uses (masked entries are -inf),
so speculative decoding can verify against exactly this distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metaloom.sampling import processors as P
from metaloom.sampling.params import SamplingParams


@dataclass(frozen=True)
class Sampler:
    """Per-row parameters of one batch, stacked into tensors once.

    ``rows[i]`` is the `SamplingParams` of row ``i``. Build with `make_sampler`.
    """

    params: tuple[SamplingParams, ...]
    temperature: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B]
    min_p: torch.Tensor  # [B]
    repetition: torch.Tensor  # [B]
    presence: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    bias: torch.Tensor | None  # [B, V] or None
    greedy: torch.Tensor  # [B] bool

    @property
    def any_penalty(self) -> bool:
        return any(p.uses_penalties for p in self.params)

    def process(self, logits: torch.Tensor, counts: torch.Tensor | None = None,
                seen: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 1-5. logits [B, V] (any float dtype) -> log-probabilities [B, V] in float32.

        counts [B, V]: output-token counts (presence/frequency); seen [B, V] bool: tokens in
        prompt or output (repetition); mask [B, V] bool: allowed tokens (constraint).
        Greedy rows come back as log-softmax of the penalised, biased, masked logits.
        """
        x = logits.float()
        if self.any_penalty:
            assert counts is not None and seen is not None, "penalties need token counts"
            x = P.repetition_penalty(x, seen, self.repetition)
            x = P.presence_frequency_penalty(x, counts, self.presence, self.frequency)
        if self.bias is not None:
            x = x + self.bias
        if mask is not None:
            x = x.masked_fill(~mask, float("-inf"))
        sampled = ~self.greedy
        if bool(sampled.any()):
            t = torch.where(self.greedy, torch.ones_like(self.temperature), self.temperature)
            y = P.temperature(x, t)
            if bool((self.top_k > 0).any()):
                y = P.top_k(y, self.top_k)
            if bool((self.top_p < 1).any()):
                y = P.top_p(y, self.top_p)
            if bool((self.min_p > 0).any()):
                y = P.min_p(y, self.min_p)
            x = torch.where(sampled[:, None], y, x)
        return torch.log_softmax(x, dim=-1)

    def select(self, rows: Sequence[int]) -> Sampler:
        """The sampler of a sub-batch (rows in the order given)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.temperature.device)
        return Sampler(
            params=tuple(self.params[r] for r in rows),
            temperature=self.temperature[index], top_k=self.top_k[index], top_p=self.top_p[index],
            min_p=self.min_p[index], repetition=self.repetition[index], presence=self.presence[index],
            frequency=self.frequency[index], bias=None if self.bias is None else self.bias[index],
            greedy=self.greedy[index])

    def draw(self, logprobs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """Step 6. logprobs [B, V] -> tokens [B] (long)."""
        tokens = logprobs.argmax(dim=-1)
        for row in torch.nonzero(~self.greedy).flatten().tolist():
            tokens[row] = P.categorical(logprobs[row], generators[row])
        return tokens


def make_sampler(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str = "cpu") -> Sampler:
    """Stack the per-row parameters of a batch (one entry per row, not per request)."""
    rows = tuple(params)
    for p in rows:
        p.check_vocab(vocab_size)

    def col(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in rows], dtype=dtype, device=device)

    bias = None
    if any(p.logit_bias for p in rows):
        bias = torch.zeros(len(rows), vocab_size, device=device)
        for i, p in enumerate(rows):
            for token, value in p.logit_bias.items():
                bias[i, token] = value
    return Sampler(
        params=rows,
        temperature=col("temperature"),
        top_k=col("top_k", torch.long),
        top_p=col("top_p"),
        min_p=col("min_p"),
        repetition=col("repetition_penalty"),
        presence=col("presence_penalty"),
        frequency=col("frequency_penalty"),
        bias=bias,
        greedy=torch.tensor([p.greedy for p in rows], dtype=torch.bool, device=device),
    )
