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


# a final-answer phrase ("The answer is", "Final answer:", GSM8K's "####"): its answer runs to
# the end of the sentence (a period before a space or the end) or of the line
_ANSWER_PHRASE = re.compile(r"(?:\b(?:final\s+)?answer\b\**\s*(?:is\b\s*:?|:)|####)\**[ \t]*(?P<span>[^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)")
_MATH_DELIMITERS = re.compile(r"\$|\\[()\[\]]")
_THOUSANDS = re.compile(r",(?=\d{3}(?!\d))")
_NUM = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
_FRAC_ARG = rf"(?:\{{\s*{_NUM}\s*\}}|\d)"
_LITERAL = re.compile(rf"{_NUM}(?:\s*/\s*{_NUM})?|[-+]?\\[dt]?frac\s*{_FRAC_ARG}\s*{_FRAC_ARG}")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "= 32": the written result of an equation (a number, not arithmetic, after the sign)
_STATED = re.compile(rf"(?<![<>!=:])=(?!=)\s*({_NUM})(?!\s*[-+*/^\d])")
# a number in scientific notation, as text or LaTeX writes it: 3.0e8, 6.02E-23,
# 6.02 \times 10^{23}, 1.5 x 10^3, 2 \cdot 10^{-5}. math-verify reads "3.0e8" as 3.0 in text and
# as 3.0·e·8 in LaTeX, and "6.02 \times 10^{23}" outside $...$ as 10: it is rewritten as the
# decimal it stands for before math-verify sees it.
_MANTISSA = r"(?P<m>[-+]?(?:\d+(?:\.\d*)?|\.\d+))"
_SCIENTIFIC = re.compile(
    rf"(?<![\w.]){_MANTISSA}(?:[eE](?P<e>[-+]?\d+)(?!\w|\.\d)"
    rf"|\s*(?:\\times|\\cdot|×|·|\*|x)\s*10\s*\^\s*(?:\{{\s*(?P<b>[-+]?\d+)\s*\}}|(?P<p>[-+]?\d+)))")
MAX_EXPONENT = 60  # beyond it the decimal would be a wall of zeros: the LaTeX power of ten stays


def _decimal(m: re.Match[str]) -> str:
    """The decimal a scientific-notation match stands for (``3.0e8`` -> ``300000000``)."""
    exponent = int(m["e"] or m["b"] or m["p"])
    if abs(exponent) > MAX_EXPONENT:
        return f"{m['m']} \\times 10^{{{exponent}}}"
    return format(Decimal(m["m"]).scaleb(exponent).normalize(), "f")


def expand_scientific(text: str) -> str:
    """``text`` with every number in scientific notation written out as a decimal."""
    return _SCIENTIFIC.sub(_decimal, text)


def _last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox``) in ``text``, braces balanced, or ``None``."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[m.start():i + 1]
    return None


def _last_side(expr: str) -> str:
    """The right-most side of an equation or chain of them (``42 - 15 = 27`` -> ``27``,
    ``a = b = 3`` -> ``3``); ``expr`` itself when it has no top-level ``=`` (``<=``, ``!=``
    and ``==`` are not equations here) or lists several (``x = 1, y = 2``)."""
    depth, cuts = 0, []
    for i, c in enumerate(expr):
        if c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == "=" and depth == 0 and expr[i - 1:i] not in ("<", ">", "!", "=", ":") and expr[i + 1:i + 2] != "=":
            cuts.append(i)
    if not cuts or re.search(r"[,;]", _THOUSANDS.sub("", expr[cuts[0]:])):
        return expr
    return expr[cuts[-1] + 1:].strip()


@dataclass(frozen=True)
class MathAnswer:
    """Final mathematical answer via `math-verify`, compared symbolically with its ``verify``.

    Where to look, first found wins: the last ``\\boxed{}``; the sentence after the last
    "the answer is" / "answer:" / "####"; the last expression in the text. An equation's
    answer is its last side (``\\boxed{42 - 15 = 27}`` -> ``27``, ``x = \\frac{3}{4}`` ->
    ``\\frac{3}{4}``). A number comes out as written (``1,234.50``, ``-3/4``), anything else
    as the LaTeX or text. Arithmetic on numbers is evaluated only where the text gives it as its
    final result, boxed or after an answer phrase (``\\boxed{42 - 15}`` -> ``27``): found
    anywhere else it is working, not an answer (``17 + 25 represents a mix`` states no
    answer; ``17 + 25 = 32 ... 17 + 25`` states 32, its last equation's result), so the
    extractor never votes for a value no sample wrote. A number in scientific notation is the
    decimal it stands for (``3.0e8`` and ``3 \\times 10^8`` -> ``300000000``: math-verify alone
    reads 3.0 and 10), and a percentage keeps its sign (``25%``, which `same` finds equal to
    0.25)."""

    name: str = "math"

    def extract(self, text: str) -> str | None:
        text = expand_scientific(text)
        boxed = _last_boxed(text)
        spans = [boxed] if boxed is not None else []
        phrases = list(_ANSWER_PHRASE.finditer(text))
        if phrases:
            span = _SENTENCE_END.split(phrases[-1]["span"], maxsplit=1)[0]
            side = _last_side(_MATH_DELIMITERS.sub(" ", span).strip(" \t*"))
            if side:  # LaTeX stays LaTeX once its delimiters are gone
                spans.append(f"${side}$" if _MATH_DELIMITERS.search(span) else side)
        for span in spans:
            found = _parse(span)
            if found is not None:
                return found
        found = _parse(text, evaluate=False)
        if found is not None:
            return found
        stated = _STATED.findall(_MATH_DELIMITERS.sub(" ", text))  # an equation's written result, if any
        return _THOUSANDS.sub("", stated[-1].rstrip(",.")) if stated else None

    def same(self, a: str, b: str) -> bool:
        if a == b:
            return True
        mv = _math_verify()
        pa, pb = _parse_answer(a), _parse_answer(b)
        return bool(pa and pb and mv.verify(pa, pb, timeout_seconds=_timeout()))


def _parse_answer(answer: str) -> list:
    """math-verify's reading of an extracted answer (LaTeX without delimiters included)."""
    mv, t = _math_verify(), _timeout()
    answer = expand_scientific(answer)  # a reference may be written 3e8
    return mv.parse(f"${answer}$", parsing_timeout=t) or mv.parse(answer, parsing_timeout=t)


def _parse(span: str, evaluate: bool = True) -> str | None:
    """The canonical answer math-verify finds in ``span``, or ``None``; ``evaluate=False``: also
    ``None`` where that answer is arithmetic on numbers (working, not a stated result)."""
    mv = _math_verify()
    parsed = mv.parse(span, parsing_timeout=_timeout())
    if not parsed:
        return None
    value, raw = parsed[0], str(parsed[-1]).strip()
    side = _last_side(raw)
    if side != raw:
        raw = side
        reparsed = _parse_answer(side)
        value = reparsed[0] if reparsed else side
    if "%" in raw or re.search(re.escape(raw) + r"\s*(?:\\?%|per\s?cent\b)", span, re.IGNORECASE) is not None:
        # a percentage keeps its sign as written: "25%" is not the number 25 (math-verify's
        # `verify` still finds 25% == 0.25 when votes are compared)
        return raw.replace("\\%", "%") if "%" in raw else raw + "%"
    canonical = _canonical(value, raw)
    return canonical if evaluate or canonical == raw else None


def _canonical(value: object, raw: str) -> str:
    """``raw`` when it is a number as written (``1,234.50``, ``-3/4``, ``\\frac{1}{2}``) or
    not a number; else the number sympy evaluates ``value`` to (``42 - 15`` -> ``27``)."""
    import sympy

    if _LITERAL.fullmatch(raw) or not isinstance(value, sympy.Basic) or not value.is_number:
        return raw
    try:
        number = value.doit()
    except Exception:  # sympy evaluation of odd input: keep the text
        return raw
    if isinstance(number, sympy.Rational):
        return str(number)  # 27, -3/4
    if isinstance(number, sympy.Float):
        try:
            return format(Decimal(str(number)).normalize(), "f")  # 0.750000000000000 -> 0.75
        except InvalidOperation:
            return raw
    return raw


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
