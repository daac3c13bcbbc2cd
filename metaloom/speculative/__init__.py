"""Speculative decoding, exact for greedy and for sampling: a drafter proposes tokens, the
target verifies them in one forward, and `core.accept` keeps what the target would have
produced (Leviathan et al. 2023; Chen et al. 2023): plain decoding's very tokens, sampled rows
included (each position's draw is plain sampling's, at the row's counter uniform; `core`).

    spec = Speculative(NgramDrafter(), num_draft=8)
    gen = LocalGenerator(loaded, speculative=spec)

The step itself (draft, verify in one forward, accept, roll the cache back) is the speculative
step of the one decode loop, `metaloom.decode.batch`; the acceptance maths is `core`.

How much to draft is the cost model's call (`planned.PlannedDrafter`; the CLI's default,
``--cost-model on``; `with_cost_model` in the library): it measures what a verify of k tokens
costs on this model and machine (`cost`), learns each drafter's acceptance while decoding
(`planner`), and drafts each step only what maximises the expected tokens per second, nothing
when nothing pays; over several drafters (``--speculative auto``) it picks the drafter too.
Without it a step always drafts ``num_draft`` tokens.

Drafters (`registry.DRAFTERS`): ``ngram`` (prompt lookup), ``draft`` (a smaller model with
the same tokenizer), ``quantized`` (the target requantised to Q8_0 or Q4_1 blocks), ``jacobi``
(fixed-point iteration), ``heads`` (speculator heads), ``recycling`` (Token Recycling, a token
tree). New ones implement `Drafter`. A drafter may propose a token tree instead of a chain
(`Draft.parents`; ``--tree``, `registry.TREE_DRAFTERS`: recycling, draft, quantized, ngram and
heads): `tree` verifies it in one tree-masked forward and accepts a path, exact for greedy and
for sampling.

Exactness is exact arithmetic's: the acceptance rule never changes the target's choice. The
floating point is the caveat. The verify forward runs k+1 positions at once, plain decoding
one, and the two go through different kernels (matmuls in `metaloom.models.engine.llama.linear` and
`metaloom.models.kernels.packed`, attention with one query or several, and on the CPU the fused
one-token kernels of `metaloom.models.kernels.fused`), so the logits differ in the last bits. In
float32 that has never flipped a token in our tests (greedy speculative equals plain greedy on
the default model, tested). In bfloat16 a near-tie can flip, and from there the two greedy
outputs part ways (seen on the benchmark's prompts; `metaloom bench speculative` reports
``same_tokens_as_greedy`` for every drafter). transformers' and vLLM's speculative decoding
have the same property; float32 is the choice when bit-for-bit equality with plain greedy
matters. One exception holds by construction: on the CPU with native quantised weights (the
one-call stack of `metaloom.models.engine.stack`), a verify of up to 65 tokens a row runs each
token through the very one-token kernels plain decoding runs (`LlamaModel._verify_fused`), so
every position's logits are plain decoding's to the bit, in float32 and bfloat16, unless
shared-prefix attention is forced ``on`` (``--shared-prefix-attention on``: the verify's tokens
then read the prompt once, merged in another order, exact to rounding only). ``auto`` never
merges a verify's tokens (`metaloom.models.engine.fused_step.sharing_of` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.speculative.core import Acceptance, accept, target_logprobs
from metaloom.speculative.drafter import MAX_DRAFT, Draft, Drafter, DraftState, Verified


@dataclass(frozen=True)
class Speculative:
    """How a generator speculates: ``drafter`` proposes up to ``num_draft`` tokens per step."""

    drafter: Drafter
    num_draft: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.num_draft, int) or isinstance(self.num_draft, bool) or not 1 <= self.num_draft <= MAX_DRAFT:
            raise InvalidParameter("num_draft", self.num_draft, f"an integer in [1, {MAX_DRAFT}]")


def with_cost_model(drafter: Drafter, num_draft: int) -> Speculative:
    """``drafter`` drafting at most ``num_draft`` tokens a step, as many as pay
    (`metaloom.speculative.planned.PlannedDrafter`; the verify cost is measured on first use)."""
    from metaloom.speculative.planned import PlannedDrafter

    return Speculative(PlannedDrafter([(drafter, num_draft)]), num_draft)


__all__ = [
    "MAX_DRAFT",
    "Acceptance",
    "Draft",
    "DraftState",
    "Drafter",
    "Speculative",
    "Verified",
    "accept",
    "target_logprobs",
    "with_cost_model",
]
