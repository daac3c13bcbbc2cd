"""A user's own verifier as a scorer: any function of (question, answer text) -> number or
bool. ``load_callable("package.module:function")`` names one from the command line."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt

VerifyFn = Callable[[str, str], float | bool]


def load_callable(spec: str) -> Callable:
    """``"module.path:attribute"`` -> that callable."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise InvalidParameter("fn", spec, "'module.path:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidParameter("fn", spec, f"an importable 'module:function' ({exc})") from exc
    if not callable(fn):
        raise InvalidParameter("fn", spec, "a callable")
    return fn


@dataclass(frozen=True)
class FunctionVerifier:
    """Scores each candidate with ``fn(question, candidate_text)``; ``True``/``False`` count as
    1.0/0.0. One scorer call per `score` call, as for every scorer."""

    fn: VerifyFn
    name: str = "verifier"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        question = user_text(prompt)
        return [float(self.fn(question, c.text)) for c in candidates]
