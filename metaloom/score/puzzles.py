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

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.arithmetic import Value, _evaluate, _shown, evaluate, reachable, solves
from metaloom.score.prompting import user_text
from metaloom.score.protocols import Prompt
from metaloom.score.puzzle_steps import Operation, check_steps, final_expression, parse_operation

# the maths and the reading of model text live in `metaloom.score.arithmetic` and
# `metaloom.score.puzzle_steps`; their public names are here too, where callers look for them
__all__ = ["STEP_FORMAT", "CountdownAnswer", "CountdownSteps", "Game24Answer", "Game24Steps", "Operation",
           "PuzzleExpression", "Value", "check_steps", "evaluate", "final_expression", "parse_countdown",
           "parse_game24", "parse_operation", "reachable", "solves", "step_prompt"]


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
