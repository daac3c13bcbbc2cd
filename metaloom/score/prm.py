"""A process reward model (PRM) as a step scorer: one probability per reasoning step that the
step is correct (Lightman et al. 2023, "Let's Verify Step by Step"; Wang et al. 2024,
Math-Shepherd; Zhang et al. 2025, Qwen2.5-Math-PRM).

Two conventions, picked from the model folder's config.json (`metaloom.models.scorers.prm`):
"classification" (Qwen2.5-Math-PRM and transformers token classifiers: the probability of the
"good" label at the separator after each step) and "tag" (Math-Shepherd: the probability of
"+" against "-" at the step tag after each step). Steps are scored as given, with their
trailing whitespace stripped before the separator / tag is appended.

One forward scores every step of a partial solution, so ``last_only`` is ignored: the scorer
always returns one score per step. A partial with no steps gets [].

Cost: one scorer call per `score_steps`, plus wall-clock seconds; the PRM's own tokens and
forwards are *not* added to the generator's token counts (it is a different model).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt

QWEN_PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


class ProcessRewardModel:
    """Scores reasoning steps with a loaded PRM (build one with `ProcessRewardModel.load`)."""

    def __init__(self, model: Any, *, name: str = "prm") -> None:
        self.model = model  # a `metaloom.models.scorers.prm.StepRewardModel` (or anything with its `step_rewards`)
        self.name = name

    @classmethod
    def load(cls, path: str, *, convention: str = "auto", device: str = "cpu", dtype: str = "auto",
             step_separator: str = "", good_token: str = "+", bad_token: str = "-", step_tag: str = "ки",
             system: str = QWEN_PRM_SYSTEM, batch_size: int = 8, max_length: int = 4096,
             trust_remote_code: bool = True) -> ProcessRewardModel:
        """A PRM from a local folder. ``convention``: "auto" (from config.json), "classification"
        (Qwen2.5-Math-PRM, token classifiers) or "tag" (Math-Shepherd). ``step_separator``: the
        classification convention's separator token ("" for the default "<extra_0>");
        ``good_token`` / ``bad_token`` / ``step_tag``: the tag convention's tokens; ``system``:
        the classification convention's system message ("" for none); ``dtype``: "auto",
        "float32", "bfloat16" or "float16"."""
        from metaloom.models.scorers.prm import StepRewardModel

        return cls(StepRewardModel.load(path, convention=convention, device=device, dtype=dtype,
                                        step_separator=step_separator or None, good_token=good_token, bad_token=bad_token,
                                        step_tag=step_tag, system=system, batch_size=batch_size, max_length=max_length,
                                        trust_remote_code=trust_remote_code))

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        start = time.perf_counter()
        try:
            return self.model.step_rewards(user_text(prompt), partial_steps)
        finally:
            ledger.charge(seconds=time.perf_counter() - start)
