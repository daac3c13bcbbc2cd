"""Exact arithmetic on a puzzle's numbers (`metaloom.score.puzzles`): whether a target can
still be reached from a pool of numbers (`reachable`), and the exact value of an expression of
integer literals (`evaluate`, `solves`). Model text is never ``eval``-ed: expressions are parsed
with `ast` and only numbers, the four operators, unary minus and parentheses are evaluated, with
exact `fractions.Fraction` arithmetic.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Sequence
from fractions import Fraction

from metaloom.errors import InvalidParameter

Value = int | Fraction


def _shown(text: str) -> str:
    return text if len(text) <= 160 else text[:160] + "..."

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
