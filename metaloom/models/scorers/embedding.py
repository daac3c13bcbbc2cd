"""A sentence-embedding model (mean-pooled, L2-normalised last hidden states, as
sentence-transformers' all-MiniLM-L6-v2 is used): the model behind the embedding-cosine MBR
utility (`metaloom.score.utility.EmbeddingCosine`), which sees only texts and numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class SentenceEmbedder:
    def __init__(self, model: Any, tokenizer: Any, *, max_tokens: int = 256, batch_size: int = 64) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.batch_size = batch_size

    @classmethod
    def load(cls, folder: str, *, device: str = "cpu", max_tokens: int = 256) -> SentenceEmbedder:
        """A transformers encoder and its tokenizer from a local folder, offline."""
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).to(device).eval()
        return cls(model, tokenizer, max_tokens=max_tokens)

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-length embeddings, ``[len(texts), hidden]``: the mean of the last hidden
        states over real (non-padding) tokens, L2-normalised."""
        device = next(self.model.parameters()).device
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(list(texts[start:start + self.batch_size]), padding=True, truncation=True,
                                       max_length=self.max_tokens, return_tensors="pt").to(device)
                hidden = self.model(**batch).last_hidden_state  # [B, T, H]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                chunks.append(torch.nn.functional.normalize(mean, p=2, dim=1))
        return torch.cat(chunks).cpu()

    def cosine(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        """u[i][j] = cosine(embed(hypotheses[i]), embed(references[j])); each distinct text
        embedded once."""
        unique = list(dict.fromkeys([*hypotheses, *references]))
        vectors = self.embed(unique)
        row = {text: i for i, text in enumerate(unique)}
        h = vectors[[row[t] for t in hypotheses]]
        r = vectors[[row[t] for t in references]]
        return (h @ r.T).clamp(-1.0, 1.0).tolist()
