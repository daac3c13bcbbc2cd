"""Quantised self-draft: the target itself with its weights requantised to 8 or 4 bits drafts
for the full-precision target (same tokenizer, same training, so drafts are accepted often).

Each linear weight (and the LM head) is requantised to one of ggml's block formats, the ones
GGUF files use: 8 bits = Q8_0 (blocks of 32 weights, one float16 scale; 1.06 bytes per
weight), 4 bits = Q4_1 (blocks of 32, a float16 scale and minimum; 0.625 bytes per weight),
and multiplied by metaloom's quantised kernels (`metaloom.models.kernels.quant`), which dequantise in
registers: a draft step reads those bytes instead of the target's 4 (float32) or 2 (bfloat16),
the win when decoding is memory-bound. Embedding, norms, RoPE and the KV cache stay the
target's (its dtype; the embedding is shared, not copied).

`QuantizedLlama` is a `LlamaModel` whose linear layers are `QuantWeight`s (the same forward),
so `DraftModelDrafter` runs it like any draft model. Exactness never depends on it: the
target verifies every draft token.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from metaloom.errors import InvalidParameter, UnsupportedModel
from metaloom.models.engine.llama import LlamaModel, Weight, plain_weight
from metaloom.models.kernels.quant import QuantWeight, quantize
from metaloom.models.protocols import KVCache, LanguageModel
from metaloom.speculative.drafters.draft_model import DraftModelDrafter

Q4_1, Q8_0 = 3, 8  # ggml type ids
BITS = {8: Q8_0, 4: Q4_1}


class QuantizedLlama(LlamaModel):
    """A native `LlamaModel` whose linear layers are the target's, requantised (see the module
    docstring). Logits come back in float32."""

    def __init__(self, target: LanguageModel, bits: int = 8) -> None:
        if bits not in BITS:
            raise InvalidParameter("bits", bits, f"one of {sorted(BITS)}")
        if not isinstance(target, LlamaModel):
            raise UnsupportedModel(f"quantised self-draft needs the native model, not {type(target).__name__}")
        if target.device.type != "cpu":
            raise UnsupportedModel(f"quantised self-draft runs on the CPU's quantised kernels, not {target.device.type}")

        def q(w: Weight) -> QuantWeight:
            w = plain_weight(w)
            if not isinstance(w, torch.Tensor):
                raise UnsupportedModel(f"the target's weights are already quantised ({type(w).__name__}); "
                                       "self-draft needs dense weights (--weights dense; load(..., weights='dense'))")
            if w.shape[1] % 32:
                raise UnsupportedModel(f"ggml blocks need input widths divisible by 32; got {w.shape[1]}")
            return quantize(w, BITS[bits])

        # replace, not a new LayerWeights: a family's extra norms (q/k, post-norms) stay
        layers = [replace(w, qkv=q(w.qkv), o=q(w.o), gate_up=q(w.gate_up), down=q(w.down)) for w in target.layers]
        super().__init__(target.config, target.embed, layers, target.norm, q(target.lm_head), target.fused)
        self.bits = bits

    def forward(self, tokens: torch.Tensor, cache: KVCache, *, valid: torch.Tensor | None = None,
                last_only: bool = False, tree: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(tokens, cache, valid=valid, last_only=last_only, tree=tree).float()


def quantized_drafter(target: LanguageModel, bits: int = 8) -> DraftModelDrafter:
    """Self-draft with ``bits`` (8 or 4) requantisation of ``target``'s weights (quantising
    takes well under a second per 100M weights; keep the drafter across calls)."""
    return DraftModelDrafter(QuantizedLlama(target, bits), name=f"quantized-int{bits}")
