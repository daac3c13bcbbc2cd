"""A transformers sequence classifier from a local folder: the model behind an outcome reward
model (`metaloom.score.reward_model`). Scorers see only `SequenceClassifier.scores`: texts in,
numbers out; the tensors and the classifier's own tokenizer stay here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from metaloom.errors import InvalidParameter, ModelNotFound


class SequenceClassifier:
    """A loaded classifier and its tokenizer (build one with `load`)."""

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 8, max_length: int = 2048) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length

    @classmethod
    def load(cls, path: str, *, device: str = "cpu", batch_size: int = 8, max_length: int = 2048) -> SequenceClassifier:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not os.path.isdir(path):
            raise ModelNotFound(f"reward model folder not found: {path}")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        if tokenizer.pad_token is None:  # decoder-only classifiers often ship without one
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        return cls(model, tokenizer, batch_size=batch_size, max_length=max_length)

    @property
    def labels(self) -> int:
        return int(self.model.config.num_labels)

    def check_label(self, label: int) -> None:
        if not -self.labels <= label < self.labels:
            raise InvalidParameter("label", label, f"an index into the model's {self.labels} labels")

    def _encode(self, question: str, answers: Sequence[str]) -> Any:
        """The question and each answer through the classifier's chat template when it has one
        (as chat reward models expect), else as a text pair."""
        if getattr(self.tokenizer, "chat_template", None):
            texts = [self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": a}], tokenize=False)
                for a in answers]
            return self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length)
        return self.tokenizer([question] * len(answers), list(answers), return_tensors="pt", padding=True,
                              truncation=True, max_length=self.max_length)

    def scores(self, question: str, answers: Sequence[str], label: int) -> list[float]:
        """The logit of ``label`` for each answer (its log-probability when the head has more
        than one label), in batches."""
        out: list[float] = []
        device = next(self.model.parameters()).device
        for lo in range(0, len(answers), self.batch_size):
            batch = self._encode(question, answers[lo:lo + self.batch_size])
            with torch.no_grad():
                logits = self.model(**{k: v.to(device) for k, v in batch.items()}).logits.float()  # [B, labels]
            if logits.shape[-1] > 1:
                logits = torch.log_softmax(logits, dim=-1)
            out.extend(logits[:, label].tolist())
        return out
