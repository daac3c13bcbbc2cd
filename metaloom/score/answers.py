"""Answer extraction for voting: map a completion to its final answer, and say when two
answers are the same, so votes gather in equivalence classes (self-consistency, Wang et al.
2023: marginalise over reasoning paths, vote over answers).

``extract`` returns a canonical string (``None`` when no answer is found: that sample does
not vote); ``same`` decides equivalence. For most extractors equivalence is string equality
of the canonical form; for maths it is `math-verify`'s symbolic check (1/2 == 0.5 == \\frac12).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Protocol, runtime_checkable

from metaloom.errors import InvalidParameter


@runtime_checkable
class Extractor(Protocol):
    @property
    def name(self) -> str: ...

    def extract(self, text: str) -> str | None:
        """The canonical final answer in ``text``, or ``None``."""
        ...

    def same(self, a: str, b: str) -> bool:
        """Whether two extracted answers are equivalent."""
        ...


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which only the main thread may use
    return 5 if threading.current_thread() is threading.main_thread() else None


def _math_verify():  # import guard: an optional dependency
    try:
        import math_verify
    except ImportError as exc:
        raise InvalidParameter("extractor", "math", "with math-verify installed: pip install math-verify") from exc
    return math_verify


@dataclass(frozen=True)
class MathAnswer:
    """Final mathematical answer via `math-verify` (boxed, "the answer is", last expression),
    compared symbolically with its ``verify``."""

    name: str = "math"

    def extract(self, text: str) -> str | None:
        mv = _math_verify()
        parsed = mv.parse(text, parsing_timeout=_timeout())
        return str(parsed[-1]) if parsed else None

    def same(self, a: str, b: str) -> bool:
        if a == b:
            return True
        mv = _math_verify()
        t = _timeout()
        return bool(mv.verify(mv.parse(a, parsing_timeout=t), mv.parse(b, parsing_timeout=t), timeout_seconds=t))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class LastNumber:
    """The last number in the text, normalised (commas dropped, 2.50 == 2.5, 3.0 == 3)."""

    name: str = "last_number"

    def extract(self, text: str) -> str | None:
        found = _NUMBER.findall(text)
        if not found:
            return None
        try:
            value = Decimal(found[-1].replace(",", "")).normalize()
        except InvalidOperation:
            return None
        return format(value, "f")

    def same(self, a: str, b: str) -> bool:
        return a == b


@dataclass(frozen=True)
class ChoiceLetter:
    """A multiple-choice letter: "the answer is (B)" first, else the last "(B)", else the
    last standalone letter among ``letters``."""

    letters: str = "ABCDE"
    name: str = "choice"

    def extract(self, text: str) -> str | None:
        ls = re.escape(self.letters)
        for pattern in (rf"answer\s*(?:is|:)?\s*\(?([{ls}])\b", rf"\(([{ls}])\)", rf"\b([{ls}])\b"):
            found = re.findall(pattern, text, flags=re.IGNORECASE if pattern.startswith("answer") else 0)
            if found:
                return found[-1].upper()
        return None

    def same(self, a: str, b: str) -> bool:
        return a == b


@dataclass(frozen=True)
class ExactString:
    """The whole text as the answer, whitespace collapsed (and case folded if asked)."""

    casefold: bool = False
    name: str = "exact"

    def extract(self, text: str) -> str | None:
        out = " ".join(text.split())
        out = out.casefold() if self.casefold else out
        return out or None

    def same(self, a: str, b: str) -> bool:
        return a == b


@dataclass(frozen=True)
class CodeOutcomes:
    """A program's answer is its behaviour: which tests it passes ("PPF"), so programs that
    behave alike vote together (AlphaCode-style clustering, Li et al. 2022). ``run_tests``
    maps a completion's text to one pass/fail per test; `execution_outcomes` binds the
    sandboxed runner of `metaloom.score.execution` to a problem's tests."""

    run_tests: Callable[[str], Sequence[bool]]
    name: str = "code_tests"

    def extract(self, text: str) -> str | None:
        return "".join("P" if ok else "F" for ok in self.run_tests(text))

    def same(self, a: str, b: str) -> bool:
        return a == b


def execution_outcomes(tests: tuple[str, ...], prefix: str = "") -> CodeOutcomes:
    """`CodeOutcomes` that run each test separately in the sandbox (the code is the
    completion's first Python block, or its text)."""
    from metaloom.score.execution import ExecutionScorer

    runner = ExecutionScorer(tests=tuple(tests), prefix=prefix, partial_credit=True)
    return CodeOutcomes(run_tests=lambda text: [r.passed for r in runner.results(text)])


def classes(answers: Sequence[str | None], extractor: Extractor) -> list[int | None]:
    """Equivalence class of each answer (``None`` for no answer): class ids in order of first
    appearance; an answer joins the first class whose representative it is ``same`` as."""
    reps: list[str] = []
    out: list[int | None] = []
    for a in answers:
        if a is None:
            out.append(None)
            continue
        for k, rep in enumerate(reps):
            if extractor.same(rep, a):
                out.append(k)
                break
        else:
            reps.append(a)
            out.append(len(reps) - 1)
    return out
