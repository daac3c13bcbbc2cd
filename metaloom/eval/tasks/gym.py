"""reasoning-gym tasks: ``countdown``, ``game24`` (puzzle24), ``arithmetic`` (basic_arithmetic),
``chain_sum`` and ``gsm`` (gsm_symbolic), graded by reasoning-gym's own ``score_answer``.

The prompts are the ones `metaloom bench search` asks (it imports them from here), so the tree
searches' step checkers read them: the puzzles in the step format (a system message, one
worked example as a previous turn, blank-line separated ``a op b = c`` steps, an ``Answer:``
line), the numeric tasks as blank-line separated steps ending ``The answer is N.``.

Problem ``i`` of a configuration is reasoning-gym's item ``i`` (id ``countdown/i``). reasoning-gym
draws item ``i`` from the seed ``seed + i`` (all but gsm_symbolic), so the problems of a smaller
``size`` are the first ones of a larger, and seeds closer together than ``size`` share
problems shifted by the difference (seed 1's problem 0 is seed 0's problem 1): space seeds
apart by more than ``size`` for disjoint sets.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.tasks.base import Grade, Problem
from metaloom.generator.types import Message
from metaloom.score.answers import Extractor, LastNumber
from metaloom.score.puzzles import PuzzleExpression, final_expression, solves

# tasks: reasoning-gym dataset and configuration. Countdown with 3 numbers up to 20 and targets
# under 100: with 4 numbers up to 25, Qwen2.5-Coder-0.5B's steps were almost never valid
# arithmetic, and every strategy scored 0 on the first problems
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "countdown": ("countdown", {"min_numbers": 3, "max_numbers": 3, "min_value": 1, "max_value": 20,
                                "min_target": 10, "max_target": 99}),
    "game24": ("puzzle24", {}),
    "arithmetic": ("basic_arithmetic", {}),
    "chain_sum": ("chain_sum", {}),
    "gsm": ("gsm_symbolic", {}),
}
PUZZLES = ("countdown", "game24")  # asked in the step format, answered with an expression
DEFAULT_SIZE = 50  # problems drawn when no limit is given

GSM_STEPS = ("{question}\n\nSolve it step by step, with a blank line between steps. End with a last step "
             "`The answer is N.`")
# basic_arithmetic ("Calculate 5 - 3 - 6.") and chain_sum ("... problem: 4 - 1 - 7 =") ask for
# a bare value; asked for steps they are searchable like GSM, and the last line is the answer
ARITHMETIC_STEPS = ("{question}\n\nWork it out step by step, one operation per step, with a blank line between "
                    "steps. End with a last step `The answer is N.`, N a plain integer.")
STEPS = {"gsm": GSM_STEPS, "arithmetic": ARITHMETIC_STEPS, "chain_sum": ARITHMETIC_STEPS}

SYSTEM = ("You solve arithmetic puzzles step by step, one operation per paragraph. Each step combines two of the "
          "numbers you still have, written `a op b = c` with op one of + - * /; the result c replaces a and b. Use "
          "every number exactly once. When only the target is left, write `Answer: ` and the whole expression with "
          "the original numbers.")
# one worked example as a previous turn: a 0.5B model asked with the example inside the question
# copies the example's answer
EXAMPLES = {"countdown": ("Find a way to make 41 using all of these numbers: 5, 7, 6.",
                          "7 * 5 = 35\n\n35 + 6 = 41\n\nAnswer: 7 * 5 + 6"),
            "game24": ("Make 24 using 2, 3, 4, 1. You can only use each number once.",
                       "2 * 3 = 6\n\n6 * 4 = 24\n\n24 * 1 = 24\n\nAnswer: 2 * 3 * 4 * 1")}


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise InvalidParameter("task", task, f"one of {sorted(TASKS)}")


def chat_prompt(task: str, question: str) -> tuple[Message, ...]:
    """The chat a reasoning-gym question is asked as: for the puzzles, the step format, one
    worked example and the puzzle's first line (reasoning-gym's answer-format lines ask for a
    bare expression, which would fight the steps); for the others, the question and the step
    format ending ``The answer is N.``."""
    _check_task(task)
    if task not in PUZZLES:
        return ({"role": "user", "content": STEPS[task].format(question=question)},)
    example, answer = EXAMPLES[task]
    return ({"role": "system", "content": SYSTEM}, {"role": "user", "content": example},
            {"role": "assistant", "content": answer}, {"role": "user", "content": question.splitlines()[0]})


def final_answer(task: str, text: str) -> str | None:
    """The final answer `metaloom bench search` grades: the last number for the numeric tasks,
    the final expression as written for the puzzles."""
    _check_task(task)
    return final_expression(text) if task in PUZZLES else LastNumber().extract(text)


def extractor_of(task: str) -> Extractor:
    """The voting extractor of a task. Numeric answers: `LastNumber`, not `MathAnswer`:
    reasoning-gym's answers here are plain decimals ("-61", "288", now and then "1687.5" in
    gsm_symbolic), basic_arithmetic grades by exact string and gsm_symbolic reads the first
    number of the answer, so the answer must come out as a plain decimal — LastNumber drops
    thousands separators and trailing zeros (1,234.50 -> 1234.5) where MathAnswer keeps a
    number as written; the prompts end on ``The answer is N.``, so the last number is the
    answer. Puzzles: `PuzzleExpression` (well-formed expressions only)."""
    _check_task(task)
    return PuzzleExpression() if task in PUZZLES else LastNumber()


def _uses_the_puzzle_numbers(task: str, answer: str, entry: Mapping[str, Any]) -> bool:
    """The 24 game's exact check: reasoning-gym's puzzle24 scorer accepts any four numbers in
    the value range, not only the puzzle's, and truncates the value with ``int()`` (24.5
    passes), so "6 * 4 * 1 * 1" would solve every puzzle; here the expression must use the
    puzzle's numbers, each once, and equal 24 exactly. Countdown's scorer already checks both."""
    return task != "game24" or solves(answer, entry["metadata"]["numbers"], 24)


WRONG_24 = 0.01  # reasoning-gym's puzzle24 score of a wrong answer


def score_answer(task: str, dataset: Any, answer: str, entry: Mapping[str, Any]) -> float:
    """reasoning-gym's ``score_answer`` of an extracted answer, except that for the 24 game an
    answer not made of the puzzle's own numbers, or not exactly 24, scores what reasoning-gym
    gives a wrong one (`_uses_the_puzzle_numbers`); 1.0 is correct."""
    score = float(dataset.score_answer(answer, dict(entry)))
    return score if _uses_the_puzzle_numbers(task, answer, entry) else min(score, WRONG_24)


@dataclass(frozen=True)
class GymTask:
    """``size`` problems of one reasoning-gym dataset (``task``: a `TASKS` name), drawn with
    ``seed``. The dataset is built on first use (reasoning-gym is imported then)."""

    task: str
    size: int = DEFAULT_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        _check_task(self.task)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise InvalidParameter("size", self.size, "an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidParameter("seed", self.seed, "an integer")

    @property
    def name(self) -> str:
        return self.task

    @property
    def dataset_name(self) -> str:
        return TASKS[self.task][0]

    @property
    def options(self) -> dict[str, Any]:
        return dict(TASKS[self.task][1])

    @functools.cached_property
    def dataset(self) -> Any:
        import reasoning_gym

        return reasoning_gym.create_dataset(self.dataset_name, size=self.size, seed=self.seed, **self.options)

    def config(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"task": self.task, "dataset": self.dataset_name, "size": self.size, "seed": self.seed,
                "options": self.options, "reasoning_gym": version("reasoning-gym")}

    @functools.cached_property
    def _problems(self) -> tuple[Problem, ...]:
        return tuple(Problem(id=f"{self.task}/{i}", prompt=chat_prompt(self.task, str(entry["question"])),
                             reference=str(entry["answer"]), data=entry)
                     for i, entry in enumerate(self.dataset))

    def problems(self) -> Sequence[Problem]:
        return self._problems

    def extractor(self) -> Extractor:
        return extractor_of(self.task)

    def public_tests(self, problem: Problem) -> None:
        return None  # puzzles and word problems: the exact checkers are the graders themselves

    def grade(self, problem: Problem, text: str) -> Grade:
        """reasoning-gym's ``score_answer`` of the extracted answer (nothing extracted: 0.0);
        correct when it gives 1.0 and, for the 24 game, the puzzle's own numbers make 24 (an
        answer only reasoning-gym accepts scores what it gives a wrong one, 0.01)."""
        answer = self.extractor().extract(text)
        if answer is None:
            return Grade(answer=None, correct=False, score=0.0)
        score = score_answer(self.task, self.dataset, answer, problem.data)
        return Grade(answer=answer, correct=score >= 1.0, score=score)
