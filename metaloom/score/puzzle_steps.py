"""Reading a puzzle solution written by a model (`metaloom.score.puzzles`): the final
expression in its text (`final_expression`: an ``<answer>`` tag, an ``Answer:`` line or a bare
expression line, LaTeX and Unicode operators read as ASCII), and its steps, each one operation
``a op b = c`` on the numbers still in the pool, checked exactly (`check_steps`; the rules are in
`metaloom.score.puzzles`).
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from metaloom.score.arithmetic import _OPS, _div, reachable, solves

# -- reading model text ----------------------------------------------------------------------

_CHARS = str.maketrans({"×": "*", "·": "*", "∗": "*", "⋅": "*", "÷": "/", "∕": "/", "−": "-", "–": "-", "—": "-",
                        "（": "(", "）": ")", "＝": "="})
_LATEX = (
    (re.compile(r"\\(?:times|cdot|ast)(?![A-Za-z])"), "*"),
    (re.compile(r"\\div(?![A-Za-z])"), "/"),
    (re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"(\1/\2)"),
    (re.compile(r"\\left|\\right|\\[()\[\]]|\$"), " "),
)
_TIMES_X = re.compile(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _normalize(text: str) -> str:
    text = text.translate(_CHARS)
    for pattern, repl in _LATEX:
        text = pattern.sub(repl, text)
    return _THOUSANDS.sub("", _TIMES_X.sub("*", text))


_RUN = re.compile(r"-?[\d(][\d\s.+\-*/()]*")
_HAS_OP = re.compile(r"[\d)]\s*[-+*/]\s*[-\d(]")
_ANSWER_PHRASE = re.compile(r"\banswer\b\s*\**\s*(?:is\b|:)", re.IGNORECASE)
_ANSWER_LABEL = re.compile(r"\banswer\b\s*\**\s*:", re.IGNORECASE)  # the step format's "Answer:"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)


def _expression_in(text: str) -> str | None:
    """The arithmetic run in ``text`` with the most numbers (the first of equals): ``Answer:
    7 * 5 + 9 - 3 = 41.`` -> ``7 * 5 + 9 - 3``."""
    best, most = None, 0
    for m in _RUN.finditer(text):
        run = m.group().rstrip(" \t.*(")
        while run.endswith(")") and run.count(")") > run.count("("):
            run = run[:-1].rstrip(" \t.*")
        while run.startswith("(") and run.count("(") > run.count(")"):
            run = run[1:].lstrip()
        count = len(re.findall(r"\d+(?:\.\d+)?", run))
        if count > most:
            best, most = run.strip(), count
    return best


def _answer_in_line(line: str, phrase: re.Pattern[str] = _ANSWER_PHRASE) -> str | None:
    """The expression after an answer phrase ("Answer:", "the answer is") in ``line``."""
    phrases = list(phrase.finditer(line))
    return _expression_in(line[phrases[-1].end():]) if phrases else None


def _bare_expression(line: str) -> str | None:
    """``line`` itself when it is nothing but an arithmetic expression with an operator."""
    text = line.strip().strip("*").strip().rstrip(".").strip()
    m = _RUN.fullmatch(text)
    return text if m and _HAS_OP.search(text) else None


def final_expression(text: str) -> str | None:
    """The final answer's expression in a completion: the last ``<answer>...</answer>`` tag,
    else the last ``Answer:`` line, else the last line that is a bare arithmetic expression;
    only the expression (``Answer: 7 * 5 + 9 - 3 = 41.`` -> ``7 * 5 + 9 - 3``). None if none."""
    text = _normalize(text)
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return _expression_in(tags[-1])
    lines = text.splitlines()
    for line in reversed(lines):
        found = _answer_in_line(line)
        if found is not None:
            return found
    for line in reversed(lines):
        found = _bare_expression(line)
        if found is not None:
            return found
    return None


# -- steps -----------------------------------------------------------------------------------

_NUMBER = r"\(?\s*-?\s*\d+(?:\.\d+)?(?:\s*/\s*\d+)?\s*\)?"
# a single equation "lhs = rhs": the result is not followed by more arithmetic (a chain
# "94 * 4 = 376 + 2 = 378" is not one operation)
_EQUATION = re.compile(rf"(?P<lhs>-?[\d(][\d\s.+\-*/()]*?)\s*=\s*(?P<rhs>{_NUMBER})(?!\d|\.\d|\s*(?:[-+*/]\s*[\d(]|=))")
_EQUATION_LINE = re.compile(r"[\d)]\s*[-+*/]\s*[-\d(][^=\n]*=")  # "digit op digit ... =": an attempted equation


def _operand(node: ast.AST, src: str) -> Fraction | None:
    """The value of a step operand: a number (``376``, ``376.0``, ``-75``) or a fraction in
    lowest terms (``8/3``, ``-(8/3)``); None for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _operand(node.operand, src)
        return None if v is None else -v
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        segment = ast.get_source_segment(src, node)
        try:
            return Fraction(segment) if segment else None
        except ValueError:
            return None
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Constant)
            and isinstance(node.right, ast.Constant) and type(node.left.value) is int and type(node.right.value) is int
            and node.right.value > 1 and math.gcd(node.left.value, node.right.value) == 1):
        return Fraction(node.left.value, node.right.value)
    return None


_RESULT = re.compile(r"(-?)(\d+(?:\.\d+)?)(?:/(\d+))?")


def _result(text: str) -> Fraction | None:
    """The value of a step's written result: a number or a fraction ``p/q``, maybe signed or
    in parentheses (``376``, ``376.0``, ``-75``, ``8/3``, ``(8/3)``)."""
    m = _RESULT.fullmatch(re.sub(r"[\s()]", "", text))
    if m is None or (m[3] and not int(m[3])):
        return None
    value = Fraction(m[2]) / (int(m[3]) if m[3] else 1)
    return -value if m[1] else value


@dataclass(frozen=True)
class Operation:
    """One step's operation ``a op b = result`` as written."""

    a: Fraction
    op: str
    b: Fraction
    result: Fraction


def _lhs_tree(lhs: str) -> tuple[ast.expr, str] | None:
    """The parsed left side of an equation, after dropping a list marker the arithmetic run
    picked up ("1. 94 * 4" -> "94 * 4") or an unbalanced "(" before it ("(94 * 4 = 376)");
    never drops an operand of an operator."""
    while lhs.startswith("(") and lhs.count("(") > lhs.count(")"):
        lhs = lhs[1:].lstrip()
    for i in range(len(lhs)):
        if i and not (lhs[i - 1].isspace() and lhs[i] in "-(0123456789" and lhs[:i].rstrip()[-1:] not in "+-*/"):
            continue
        try:
            return ast.parse(lhs[i:], mode="eval").body, lhs[i:]
        except SyntaxError:
            continue
    return None


def parse_operation(line: str) -> Operation | None:
    """The last equation in ``line`` as one operation (``Step 1: 94 x 4 = 376.`` ->
    ``94 * 4 = 376``), or None when it is not one (a chain, a compound left side, no
    equation)."""
    line = _normalize(line)
    found = list(_EQUATION.finditer(line))
    if not found:
        return None
    m = found[-1]
    if line[:m.start()].rstrip().endswith("="):
        return None  # the tail of a chain "94 * 4 = 376 + 2 = 378"
    parsed = _lhs_tree(m["lhs"].strip())
    if parsed is None:
        return None
    body, lhs = parsed
    if not (isinstance(body, ast.BinOp) and type(body.op) in _OPS):
        return None
    a, b, result = _operand(body.left, lhs), _operand(body.right, lhs), _result(m["rhs"])
    if a is None or b is None or result is None:
        return None
    return Operation(a, _OPS[type(body.op)], b, result)


def _read_step(step: str) -> tuple[str, str | Operation | None]:
    """``("answer", expression)``, ``("equation", Operation or None when malformed)`` or
    ``("prose", None)``. An answer line wins; else the last line holding an equation counts."""
    lines = _normalize(step).splitlines()
    for line in reversed(lines):
        found = _answer_in_line(line, _ANSWER_LABEL)
        if found is not None:
            return "answer", found
    for line in reversed(lines):
        if _EQUATION_LINE.search(line):
            return "equation", parse_operation(line)
    return "prose", None


def _apply(op: Operation, integer_only: bool) -> Fraction | None:
    if op.op == "+":
        return op.a + op.b
    if op.op == "-":
        return op.a - op.b
    if op.op == "*":
        return op.a * op.b
    q = _div(op.a, op.b, integer_only)
    return None if q is None else Fraction(q)


def check_steps(steps: Sequence[str], numbers: Sequence[int], target: int, *, integer_only: bool,
                prose_score: float = 0.5, reach_limit: int = 6) -> list[float]:
    """One score per step of a partial solution, replaying its operations over the pool:

    - an operation step: 1.0 when both operands are in the pool, the written result is exact
      (and a whole number under ``integer_only``) and the target is still reachable from the
      new pool using all of it; else 0.0. A pool larger than ``reach_limit`` is not searched
      (a correct operation then scores 1.0);
    - an ``Answer:`` step: 1.0 when its expression `solves` the puzzle (the original numbers,
      each once, equal to the target), else 0.0;
    - prose (no equation, no answer): ``prose_score``, the pool unchanged;
    - every step after a 0.0 step (a mistake or a dead end) scores 0.0; steps after a correct
      answer score 1.0 (the solution is complete), unless they give another, wrong answer.
    """
    pool = Counter(Fraction(n) for n in numbers)
    scores: list[float] = []
    state = "open"  # "open" -> "failed" | "solved"
    for step in steps:
        if state == "failed":
            scores.append(0.0)
            continue
        kind, payload = _read_step(step)
        if kind == "answer":
            ok = isinstance(payload, str) and solves(payload, numbers, target)
            state = "solved" if ok else "failed"
            scores.append(1.0 if ok else 0.0)
            continue
        if state == "solved":
            scores.append(1.0)
            continue
        if kind == "prose":
            scores.append(prose_score)
            continue
        ok = False
        if isinstance(payload, Operation):
            op = payload
            present = pool[op.a] >= 2 if op.a == op.b else pool[op.a] >= 1 and pool[op.b] >= 1
            if present and _apply(op, integer_only) == op.result:
                pool[op.a] -= 1
                pool[op.b] -= 1
                pool[op.result] += 1
                left = list(pool.elements())
                ok = len(left) > reach_limit or reachable(left, target, integer_only=integer_only)
        scores.append(1.0 if ok else 0.0)
        state = "open" if ok else "failed"
    return scores
