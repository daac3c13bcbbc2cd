"""Exact checkers for arithmetic puzzles: reasoning-gym's ``countdown`` (make a target from
4-6 numbers) and ``puzzle24`` (make 24 from four numbers), as step scorers for a tree search
that writes a solution one operation at a time, and as final-answer scorers.

The rules follow reasoning-gym's own scorers (``score_answer``), not the question wording:

- a final answer is an arithmetic expression of integer literals, ``+ - * /``, unary minus
  and parentheses. Its literals must be exactly the puzzle's numbers (as a multiset: every
  number used once; countdown's scorer compares sorted lists even where the question says
  "may be used at most once"), and its exact value must equal the target. Intermediate
  fractions are fine (reasoning-gym evaluates with sympy): ``8 / (3 - 8 / 3)`` makes 24.
  Extraction is lenient: the expression is found in an ``<answer>`` tag, an ``Answer:``
  line or a bare expression line, and a trailing ``= 41`` or sentence is dropped.
  For ``puzzle24`` this is stricter than reasoning-gym in two places where its scorer is
  loose: it accepts any four numbers within the value range (not only the puzzle's) and
  truncates the value with ``int()`` (24.5 passes); here neither passes.
- a step is one operation on two numbers still in the pool, ``a op b = c``; ``c`` replaces
  ``a`` and ``b``. For countdown a division must be exact (``integer_only``, default on):
  reasoning-gym's generator only builds integer divisions, so every generated puzzle has an
  integer-only solution, although its final grading would accept fractional intermediates
  (set ``integer_only=False`` to allow them in steps too). For the 24 game fractions are
  allowed, written ``p/q`` (``8 / 3 = 8/3``, then ``3 - 8/3 = 1/3``); a decimal result must
  be exact (``8 / 3 = 2.67`` is wrong). Negative and zero intermediates are allowed
  (reasoning-gym allows them), division by zero is not.
- a step scores 1.0 when it is such an operation, correct, and the target is still reachable
  using all of the new pool (`reachable`); 0.0 otherwise, and so does every later step. A
  step without an equation (prose) scores ``prose_score`` (0.5: it neither advances nor
  breaks the solution, so it ranks between a checked step and a wrong one). An ``Answer:``
  step is graded as a final answer. See `check_steps`.

Model text is never ``eval``-ed: expressions are parsed with `ast` and only numbers, the four
operators, unary minus and parentheses are evaluated, with exact `fractions.Fraction`
arithmetic.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt

Value = int | Fraction

STEP_FORMAT = (
    "{question}\n"
    "Solve it step by step: one operation per step, with a blank line between steps.\n"
    "- Each step combines two of the numbers you still have, written as `a op b = c` with op one of + - * /, "
    "for example `94 * 4 = 376`. The result c replaces a and b among your numbers.\n"
    "- Use every number exactly once. In Countdown a division must come out whole; in the 24 game a fraction "
    "is fine, written p/q (`8 / 3 = 8/3`).\n"
    "- When the only number left is the target, write the last step as `Answer: ` followed by the whole "
    "expression with the original numbers, in the final answer format above.\n"
    "\n"
    "Example, with the numbers 3, 5, 7, 9 and the target 41:\n"
    "7 * 5 = 35\n"
    "\n"
    "35 + 9 = 44\n"
    "\n"
    "44 - 3 = 41\n"
    "\n"
    "Answer: 7 * 5 + 9 - 3\n"
)


def step_prompt(question: str) -> str:
    """A reasoning-gym countdown / puzzle24 question followed by the step format and its
    worked example (phrased so that `parse_countdown` and `parse_game24` never read it)."""
    return STEP_FORMAT.format(question=question.rstrip())


# -- questions ----------------------------------------------------------------------------

_LIST = r"\d+(?:\s*,\s*\d+)+"
_COUNTDOWN_QUESTIONS = (
    # reasoning-gym's three templates: "Using all the numbers a, b, c, create an expression that
    # equals T.", "Find a way to make T using all of these numbers: a, b, c.", "Calculate T ..."
    re.compile(rf"using all (?:of )?the numbers:?\s*(?P<numbers>{_LIST}),?\s*create an expression that equals\s*(?P<target>\d+)",
               re.IGNORECASE),
    re.compile(rf"\b(?:make|calculate|reach|get)\s+(?P<target>\d+)\s+using all (?:of )?(?:these|the) numbers:?\s*"
               rf"(?P<numbers>{_LIST})", re.IGNORECASE),
)
_GAME24_QUESTION = re.compile(rf"\bmake\s+24\s+using\s+(?P<numbers>{_LIST})", re.IGNORECASE)


def _shown(question: str) -> str:
    return question if len(question) <= 160 else question[:160] + "..."


def _first_match(patterns: Iterable[re.Pattern[str]], text: str) -> re.Match[str] | None:
    found = [m for p in patterns if (m := p.search(text))]
    return min(found, key=lambda m: m.start()) if found else None


@functools.lru_cache(maxsize=256)
def parse_countdown(question: str) -> tuple[tuple[int, ...], int]:
    """``(numbers, target)`` of a reasoning-gym countdown question (the first one in the
    text); `InvalidParameter` when the text holds none."""
    m = _first_match(_COUNTDOWN_QUESTIONS, question)
    if m is None:
        raise InvalidParameter("question", _shown(question),
                               "a countdown question ('Calculate T using all of these numbers: a, b, c.', "
                               "'Find a way to make T using all of these numbers: ...', "
                               "'Using all the numbers a, b, c, create an expression that equals T.')")
    return tuple(int(n) for n in re.findall(r"\d+", m["numbers"])), int(m["target"])


@functools.lru_cache(maxsize=256)
def parse_game24(question: str) -> tuple[tuple[int, ...], int]:
    """``(numbers, 24)`` of a reasoning-gym puzzle24 question ("Make 24 using a, b, c, d.");
    `InvalidParameter` when the text holds none."""
    m = _GAME24_QUESTION.search(question)
    if m is None:
        raise InvalidParameter("question", _shown(question), "a 24-game question ('Make 24 using a, b, c, d. ...')")
    return tuple(int(n) for n in re.findall(r"\d+", m["numbers"])), 24


# -- reachability --------------------------------------------------------------------------


def _norm(v: Value) -> Value:
    return int(v) if v.denominator == 1 else v


def _div(a: Value, b: Value, integer_only: bool) -> Value | None:
    """``a / b``, or None for division by zero or (integer_only) an inexact division."""
    if not b:
        return None
    if isinstance(a, int) and isinstance(b, int):
        if a % b == 0:
            return a // b
        return None if integer_only else Fraction(a, b)
    q = Fraction(a) / b
    return None if integer_only and q.denominator != 1 else _norm(q)


def _results(a: Value, b: Value, integer_only: bool) -> list[Value]:
    """Every value one operation on ``a`` and ``b`` (either order) gives."""
    out = [a + b, a * b, a - b, b - a]
    for q in (_div(a, b, integer_only), _div(b, a, integer_only)):
        if q is not None:
            out.append(q)
    return out


def _partners(x: Value, t: Value, integer_only: bool) -> list[Value]:
    """The values y for which one operation on x and y (either order) gives t. (``0 * y``
    for any y is left out: whenever it makes t = 0, another cut of the pool does too.)"""
    out = [t - x, x - t, t + x]  # x + y, x - y, y - x
    if x:
        out.append(t * x)  # y / x
        for y in (_div(t, x, integer_only), _div(x, t, integer_only) if t else None):  # x * y, x / y
            if y is not None:
                out.append(y)
    return out


@functools.lru_cache(maxsize=1024)
def _splits(ms: tuple[Value, ...]) -> tuple[tuple[tuple[Value, ...], tuple[Value, ...]], ...]:
    """The distinct ways to cut a sorted multiset into two non-empty parts (unordered)."""
    n, seen = len(ms), set()
    for mask in range(2 ** (n - 1) - 1):  # index 0 always in the first part; the second never empty
        first = (ms[0], *(ms[i] for i in range(1, n) if mask >> (i - 1) & 1))
        second = tuple(ms[i] for i in range(1, n) if not mask >> (i - 1) & 1)
        seen.add((first, second) if (len(first), first) <= (len(second), second) else (second, first))
    return tuple(sorted(seen, key=lambda s: (len(s[0]), s)))


@functools.lru_cache(maxsize=8192)
def _values(ms: tuple[Value, ...], integer_only: bool) -> frozenset[Value]:
    """Every value an expression using each number of the multiset exactly once can take."""
    if len(ms) == 1:
        return frozenset(ms)
    out: set[Value] = set()
    for a_part, b_part in _splits(ms):
        vb = _values(b_part, integer_only)
        for a in _values(a_part, integer_only):
            for b in vb:
                out.update(_results(a, b, integer_only))
    return frozenset(out)


_DIRECT = 4  # parts up to this size have their value sets built; larger ones are searched


@functools.lru_cache(maxsize=1 << 16)
def _reach(ms: tuple[Value, ...], t: Value, integer_only: bool) -> bool:
    if len(ms) == 1:
        return ms[0] == t
    if len(ms) == 2:
        return t in _results(ms[0], ms[1], integer_only)
    if integer_only and isinstance(t, Fraction) and all(isinstance(v, int) for v in ms):
        return False  # integer-only arithmetic on integers never leaves the integers
    for small, big in _splits(ms):  # len(small) <= len(big)
        vs = _values(small, integer_only)
        if len(big) <= _DIRECT:
            vb = _values(big, integer_only)
            if any(y in vb for x in vs for y in _partners(x, t, integer_only)):
                return True
        elif any(_reach(big, y, integer_only) for x in vs for y in _partners(x, t, integer_only)):
            return True
    return False


def _key(numbers: Iterable[Value]) -> tuple[Value, ...]:
    return tuple(sorted(_norm(Fraction(n)) for n in numbers))


def reachable(numbers: Iterable[int | Fraction], target: int | Fraction, *, integer_only: bool,
              use_all: bool = True) -> bool:
    """Whether ``target`` can be made from ``numbers`` with ``+ - * /``, each number used
    once: all of them (``use_all``, the rule reasoning-gym grades) or any non-empty part.
    ``integer_only``: every division must be exact. Exhaustive and exact (fractions), memoised
    over multisets across calls. Measured cold (2-core machine): typical 4-6 number pools take
    0.1-8 ms; the worst seen, an unreachable 6-number pool with fractions, about 0.1 s."""
    ms, t = _key(numbers), _norm(Fraction(target))
    if not ms:
        return False
    if use_all:
        return _reach(ms, t, integer_only)
    parts = {tuple(ms[i] for i in range(len(ms)) if mask >> i & 1) for mask in range(1, 2 ** len(ms))}
    return any(_reach(p, t, integer_only) for p in parts)


# -- safe arithmetic -------------------------------------------------------------------------

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_MAX_EXPRESSION = 400


def _evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value and integer literals of an expression of integer literals, + - * /, unary
    minus/plus and parentheses; `InvalidParameter` for anything else."""
    allowed = "integer literals, + - * /, unary minus and parentheses"
    if len(expression) > _MAX_EXPRESSION:
        raise InvalidParameter("expression", _shown(expression), f"at most {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise InvalidParameter("expression", expression, f"an arithmetic expression of {allowed}") from exc
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if not b:
                raise InvalidParameter("expression", expression, "no division by zero")
            return a / b
        raise InvalidParameter("expression", expression, f"only {allowed} (found {ast.dump(node)[:60]})")

    return walk(tree.body), literals


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (integer literals, + - * /, unary minus,
    parentheses), parsed with `ast`, never ``eval``-ed; `InvalidParameter` for anything else
    or a division by zero."""
    return _evaluate(expression)[0]


def solves(expression: str | None, numbers: Sequence[int], target: int) -> bool:
    """Whether ``expression`` uses exactly ``numbers`` (each once) and equals ``target``: the
    condition under which reasoning-gym's countdown scorer gives 1.0."""
    if expression is None:
        return False
    try:
        value, literals = _evaluate(expression)
    except InvalidParameter:
        return False
    return sorted(literals) == sorted(numbers) and value == target


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


# -- scorers ---------------------------------------------------------------------------------


def _check_settings(prose_score: float, reach_limit: int) -> None:
    if not 0.0 <= prose_score <= 1.0:
        raise InvalidParameter("prose_score", prose_score, "a number in [0, 1]")
    if reach_limit < 1:
        raise InvalidParameter("reach_limit", reach_limit, "an integer >= 1")


@dataclass(frozen=True)
class CountdownSteps:
    """Step scorer for reasoning-gym countdown (see `check_steps`); the numbers and target
    come from the prompt's question. ``last_only`` is ignored: every step is scored (cheap)."""

    prose_score: float = 0.5
    integer_only: bool = True
    reach_limit: int = 6
    name: str = "countdown"

    def __post_init__(self) -> None:
        _check_settings(self.prose_score, self.reach_limit)

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        numbers, target = parse_countdown(user_text(prompt))
        return [check_steps(steps, numbers, target, integer_only=self.integer_only, prose_score=self.prose_score,
                            reach_limit=self.reach_limit) for steps in partial_steps]


@dataclass(frozen=True)
class Game24Steps:
    """Step scorer for reasoning-gym puzzle24 (see `check_steps`; fractions allowed)."""

    prose_score: float = 0.5
    reach_limit: int = 6
    name: str = "game24"

    def __post_init__(self) -> None:
        _check_settings(self.prose_score, self.reach_limit)

    def score_steps(self, prompt: Prompt, partial_steps: Sequence[Sequence[str]], *, ledger: Ledger,
                    last_only: bool = False) -> list[list[float]]:
        ledger.charge(scorer_calls=1)
        numbers, target = parse_game24(user_text(prompt))
        return [check_steps(steps, numbers, target, integer_only=False, prose_score=self.prose_score,
                            reach_limit=self.reach_limit) for steps in partial_steps]


@dataclass(frozen=True)
class CountdownAnswer:
    """1.0 when a completion's `final_expression` `solves` the countdown question, else 0.0
    (reasoning-gym's ``score_answer`` gives 1.0 exactly then)."""

    name: str = "countdown"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        numbers, target = parse_countdown(user_text(prompt))
        return [float(solves(final_expression(c.text), numbers, target)) for c in candidates]


@dataclass(frozen=True)
class Game24Answer:
    """1.0 when a completion's `final_expression` uses the puzzle's four numbers once each and
    equals 24 exactly, else 0.0 (stricter than reasoning-gym's puzzle24 scorer; module doc)."""

    name: str = "game24"

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        numbers, target = parse_game24(user_text(prompt))
        return [float(solves(final_expression(c.text), numbers, target)) for c in candidates]


@dataclass(frozen=True)
class PuzzleExpression:
    """`Extractor` of the final expression (`final_expression`, spaces removed; None when it
    is not a well-formed expression), for voting: equal expressions vote together."""

    name: str = "puzzle_expression"

    def extract(self, text: str) -> str | None:
        found = final_expression(text)
        if found is None:
            return None
        try:
            _evaluate(found)
        except InvalidParameter:
            return None
        return "".join(found.split())

    def same(self, a: str, b: str) -> bool:
        return a == b
