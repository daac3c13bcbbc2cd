"""Retrieval over a local corpus with BM25 (Robertson & Zaragoza 2009; the ``bm25s`` library):
the model asks a query, the tool returns the best-matching documents — the retrieval step of
Self-Ask and ReAct (Press et al. 2023; Yao et al. 2023) without a web search."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.tools.base import ToolError, string_argument

SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
          "additionalProperties": False}
TEXT_KEYS = ("text", "contents", "content", "document")  # where a JSONL object keeps its text
NO_MATCH = "No document matches the query."


def read_corpus(path: str | Path) -> tuple[str, ...]:
    """Documents of a file, one a line (blank lines skipped): plain text, or for ``.jsonl`` a
    JSON string or an object with a ``text`` (``contents``, ``content``, ``document``) field."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameter("corpus", str(path), "a text or JSONL file, one document a line")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if p.suffix != ".jsonl":
        return tuple(line.strip() for line in lines)
    docs = []
    for i, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidParameter("corpus", f"{path}:{i}", f"one JSON value a line ({exc})") from exc
        text = item if isinstance(item, str) else next(
            (item[k] for k in TEXT_KEYS if isinstance(item, dict) and isinstance(item.get(k), str)), None)
        if text is None:
            raise InvalidParameter("corpus", f"{path}:{i}", f"a JSON string or an object with one of {TEXT_KEYS}")
        docs.append(text)
    return tuple(docs)


def _tokenize(texts: Sequence[str]) -> Any:
    import bm25s

    return bm25s.tokenize(list(texts), stopwords="en", show_progress=False)


@dataclass(frozen=True)
class Search:
    """Return the ``top_k`` documents of the corpus that best match a query (BM25)."""

    documents: tuple[str, ...]
    top_k: int = 3
    name: str = "search"
    description: str = "Searches a local collection of documents and returns the best matches for a query."
    schema: Mapping[str, Any] = field(default_factory=lambda: SCHEMA)
    index: Any = field(default=None, init=False, repr=False, compare=False)  # the bm25s index, built once

    def __post_init__(self) -> None:
        if not isinstance(self.documents, tuple) or not self.documents or not all(isinstance(d, str) for d in self.documents):
            raise InvalidParameter("corpus", self.documents, "at least one document (text)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise InvalidParameter("top_k", self.top_k, "an integer >= 1")
        import bm25s

        tokens = _tokenize(self.documents)
        if not tokens.vocab:  # bm25s cannot index a corpus of stop words
            raise InvalidParameter("corpus", self.documents[:3], "documents with at least one word that is not a stop word")
        index = bm25s.BM25()
        index.index(tokens, show_progress=False)
        object.__setattr__(self, "index", index)  # derived from documents, fixed with them

    @classmethod
    def load(cls, corpus: str | Path | Sequence[str], top_k: int = 3) -> Search:
        """From a list of documents, or a file (`read_corpus`)."""
        docs = read_corpus(corpus) if isinstance(corpus, (str, Path)) else tuple(corpus)
        return cls(docs, top_k)

    def ranked(self, query: str) -> list[tuple[int, float]]:
        """(document index, BM25 score) of the matching documents, best first, at most ``top_k``;
        documents sharing no term with the query are left out."""
        tokens = _tokenize([query])
        if not any(len(ids) for ids in tokens.ids):  # only stop words, or nothing
            return []
        ids, scores = self.index.retrieve(tokens, k=min(self.top_k, len(self.documents)), show_progress=False)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def call(self, arguments: Mapping[str, Any]) -> str:
        query = string_argument(arguments, "query")
        if not query.strip():
            raise ToolError("the query is empty")
        hits = self.ranked(query)
        if not hits:
            return NO_MATCH
        return "\n".join(f"[{rank}] {self.documents[i]}" for rank, (i, _) in enumerate(hits, 1))
