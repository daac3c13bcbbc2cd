"""A calculator that evaluates arithmetic by walking Python's syntax tree — never ``eval``.

Allowed: int and float literals, ``+ - * / // % **``, unary ``-`` and ``+``, parentheses,
the functions in `FUNCTIONS` (positional arguments only) and the constants in `CONSTANTS`.
Anything else (other names, attribute access, subscripts, strings, comparisons, lambdas,
keyword arguments) is refused with `ToolError`, as are results that would be huge: a power
whose result would pass `MAX_BITS` bits is refused before it is computed.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.tools.base import ToolError, string_argument

MAX_CHARS = 1000  # longer expressions are refused before parsing
MAX_BITS = 4096  # the largest integer result (about 1233 decimal digits)

Number = int | float

OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
    "exp": math.exp, "log": math.log, "min": min, "max": max,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}
# maxLength: under a grammar, a model that starts repeating "+ 45 + 45 ..." is stopped at the
# bound (the string closes) instead of running to max_tokens with the call unfinished
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 200}},
          "required": ["expression"], "additionalProperties": False}


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ToolError(f"result too large (more than {MAX_BITS} bits)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused when the result would pass `MAX_BITS` bits (checked from
    logarithms, before computing it)."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log2(abs(base)) > MAX_BITS:
        raise ToolError(f"{base} ** {exponent} is too large (more than {MAX_BITS} bits)")
    if abs(base) < 1 and base != 0 and exponent < 0 and -exponent * math.log2(1 / abs(base)) > MAX_BITS:
        raise ToolError(f"{base} ** {exponent} is too large (more than {MAX_BITS} bits)")
    result = base**exponent
    if isinstance(result, complex):  # (-8) ** (1/3)
        raise ToolError(f"{base} ** {exponent} is not a real number")
    return result


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        return _check_size(OPERATORS[type(node.op)](left, right))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise ToolError(f"unknown name {node.id!r}; allowed: functions {sorted(FUNCTIONS)}, constants {sorted(CONSTANTS)}")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise ToolError(f"only the functions {sorted(FUNCTIONS)} may be called")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ToolError(f"{node.func.id}() takes positional number arguments only")
        return _check_size(FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
    raise ToolError(f"{type(node).__name__} is not arithmetic ({ast.unparse(node)!r})")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``; `ToolError` for anything else."""
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an expression: {expression!r}") from exc
    try:
        value = _eval(tree)
    except ToolError:
        raise
    except (ArithmeticError, ValueError, TypeError, RecursionError) as exc:  # 1/0, sqrt(-1), round(1, 2, 3)
        raise ToolError(f"{type(exc).__name__}: {exc}") from exc
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is not finite ({value})")
    return value


def format_number(value: Number) -> str:
    """Integers exactly; floats to 12 significant digits, integral ones without ".0"."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


@dataclass(frozen=True)
class Calculator:
    """Evaluate an arithmetic expression, e.g. ``{"expression": "(3 + 4) * sqrt(2)"}``."""

    name: str = "calculator"
    description: str = ("Evaluates an arithmetic expression: numbers, + - * / // % **, parentheses, "
                        "sqrt abs round floor ceil exp log min max, pi, e.")
    schema: Mapping[str, Any] = field(default_factory=lambda: SCHEMA)

    def call(self, arguments: Mapping[str, Any]) -> str:
        return format_number(evaluate(string_argument(arguments, "expression")))
