"""An outcome reward model (ORM) as a scorer: any transformers sequence-classification model
from a local folder (Cobbe et al. 2021 verifiers; Stiennon et al. 2020 reward models).

The score is the logit of ``label`` — the reward itself for a one-label regression head (the
usual reward model), or the log-probability of ``label`` for a classifier ("correct" vs not).
The model runs in `metaloom.models.scorers.classifier`; this scorer sees only text and numbers.

Cost: one scorer call per `score`, plus wall-clock seconds; the reward model's own tokens and
forwards are *not* added to the generator's token counts (they are a different model).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt


class RewardModel:
    """Scores candidates with a loaded classifier (build one with `RewardModel.load`)."""

    def __init__(self, classifier: Any, *, label: int = -1, name: str = "reward_model") -> None:
        classifier.check_label(label)
        self.classifier = classifier
        self.label = label
        self.name = name

    @classmethod
    def load(cls, path: str, *, device: str = "cpu", label: int = -1, batch_size: int = 8,
             max_length: int = 2048) -> RewardModel:
        """An outcome reward model: a transformers sequence classifier from a local folder."""
        from metaloom.models.scorers.classifier import SequenceClassifier

        return cls(SequenceClassifier.load(path, device=device, batch_size=batch_size, max_length=max_length), label=label)

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        start = time.perf_counter()
        out = self.classifier.scores(user_text(prompt), [c.text for c in candidates], self.label)
        ledger.charge(seconds=time.perf_counter() - start)
        return out
