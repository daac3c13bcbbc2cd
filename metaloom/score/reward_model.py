"""An outcome reward model (ORM) as a scorer: any transformers sequence-classification model
from a local folder (Cobbe et al. 2021 verifiers; Stiennon et al. 2020 reward models).

The score is the logit of ``label`` — the reward itself for a one-label regression head (the
usual reward model), or the log-probability of ``label`` for a classifier ("correct" vs not).
The question and candidate go through the model's chat template when its tokenizer has one
(as chat reward models expect), else are joined as a text pair.

Cost: one scorer call per `score`, plus wall-clock seconds; the reward model's own tokens and
forwards are *not* added to the generator's token counts (they are a different model).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from metaloom.errors import InvalidParameter, ModelNotFound
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt


class RewardModel:
    """Holds a loaded classifier and its tokenizer (build one with `RewardModel.load`)."""

    def __init__(self, model: Any, tokenizer: Any, *, label: int = -1, batch_size: int = 8,
                 max_length: int = 2048, name: str = "reward_model") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.label = label
        self.batch_size = batch_size
        self.max_length = max_length
        self.name = name

    @classmethod
    def load(cls, path: str, *, device: str = "cpu", label: int = -1, batch_size: int = 8,
             max_length: int = 2048) -> RewardModel:
        """An outcome reward model: a transformers sequence classifier from a local folder."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not os.path.isdir(path):
            raise ModelNotFound(f"reward model folder not found: {path}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if tokenizer.pad_token is None:  # decoder-only classifiers often ship without one
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        labels = model.config.num_labels
        if not -labels <= label < labels:
            raise InvalidParameter("label", label, f"an index into the model's {labels} labels")
        return cls(model, tokenizer, label=label, batch_size=batch_size, max_length=max_length)

    def _encode(self, question: str, answers: Sequence[str]) -> Any:
        if getattr(self.tokenizer, "chat_template", None):
            texts = [self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": a}], tokenize=False)
                for a in answers]
            return self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
        return self.tokenizer([question] * len(answers), list(answers), return_tensors="pt", padding=True,
                              truncation=True, max_length=self.max_length)

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        import torch

        ledger.charge(scorer_calls=1)
        start = time.perf_counter()
        question, out = user_text(prompt), []
        device = next(self.model.parameters()).device
        for lo in range(0, len(candidates), self.batch_size):
            batch = self._encode(question, [c.text for c in candidates[lo:lo + self.batch_size]])
            with torch.no_grad():
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits.float()  # [B, labels]
            if logits.shape[-1] > 1:
                logits = torch.log_softmax(logits, dim=-1)
            out.extend(logits[:, self.label].tolist())
        ledger.charge(seconds=time.perf_counter() - start)
        return out
