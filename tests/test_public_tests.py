"""Public tests (`metaloom.score.public_tests`): a coding problem's docstring examples as the
tests `refine`, `refine_tree` and `best_of_n` may run in `metaloom eval`, while the hidden tests
stay the grader's."""

from __future__ import annotations

import json

import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.runner import plan_sweep, run_sweep
from metaloom.eval.tasks.humaneval import HumanEval, chat_prompt
from metaloom.eval.worker import Setup, Worker
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.execution import ExecutionScorer, run_tests
from metaloom.score.feedback import ExecutionFeedback
from metaloom.score.humaneval import load_humaneval
from metaloom.score.public_tests import PublicTests, docstring_examples, public_tests
from metaloom.testing.scripted import Say, ScriptedGenerator
from metaloom.wiring.configure import build_strategy
from metaloom.wiring.spec import parse_spec

PROMPT = '''from typing import List


def f(xs: List[int], k: int = 1) -> int:
    """ Sum, then scale.
    >>> f([1, 2], 3)
    9
    >>> f([])
    0
    >>> f([1, 2], 3)
    9
    >>> g(1)
    2
    Examples:
    f([4]) == 4
    * f([5], 2) ➞ 10
    for f([1, 1]) => 2.
    f([2]) returns 2
    f([3]) should return 3.
    f(x) == 4
    f([6]) -> 6 - 0 = 6
    f([7]) == 7  # a comment
    """
'''


def test_examples_are_read_from_doctests_and_prose_as_written() -> None:
    assert docstring_examples(PROMPT, "f") == [
        ("f([1, 2], 3)", "9"), ("f([])", "0"),  # doctests, the repeat dropped, g's left out
        ("f([4])", "4"), ("f([5], 2)", "10"), ("f([1, 1])", "2"), ("f([2])", "2"), ("f([3])", "3"),
        ("f([7])", "7"),  # comment dropped; f(x) names no value, "6 - 0 = 6" is not one
    ]


def test_a_docstring_doctest_cannot_read_still_gives_its_prose_examples() -> None:
    prompt = 'def f(s):\n    """\n    >>> f("a\n  b")\n    1\n    f("c") == 2\n    """\n'
    assert docstring_examples(prompt, "f") == [("f('c')", "2")]


def test_each_test_says_what_the_call_returned() -> None:
    tests = public_tests(PROMPT, "f")
    wrong = tests.prefix + "    return 1\n"
    run = run_tests(wrong + tests.tests[0])
    assert not run.passed and "f([1, 2], 3) returned 1, expected 9" in run.failure
    right = tests.prefix + "    return sum(xs) * k\n"
    assert all(run_tests(right + t).passed for t in tests.tests)


def test_floats_compare_within_a_relative_tolerance() -> None:
    tests = public_tests('def h():\n    """\n    >>> h()\n    0.3\n    """\n', "h")
    assert run_tests(tests.prefix + "    return 0.1 + 0.2\n" + tests.tests[0]).passed
    assert not run_tests(tests.prefix + "    return 0.31\n" + tests.tests[0]).passed


def test_a_problem_without_examples_gets_a_test_that_its_code_runs() -> None:
    tests = public_tests('def h(x):\n    """Do it."""\n', "h")
    assert len(tests.tests) == 1
    assert run_tests(tests.prefix + "def h(x):\n    return x\n" + tests.tests[0]).passed
    assert not run_tests(tests.prefix + "def h(x):\n    return x +\n" + tests.tests[0]).passed  # a syntax error
    assert not run_tests(tests.prefix + "import no_such_module\n" + tests.tests[0]).passed


def test_humaneval_canonical_solutions_pass_their_public_tests_except_where_the_docstring_is_wrong() -> None:
    """The first 50 tasks: every canonical solution passes the examples its docstring shows,
    but HumanEval/47, whose docstring gives the median of six numbers wrong (module doc)."""
    failing = []
    with_examples = 0
    for row in load_humaneval()[:50]:
        tests = public_tests(row.prompt, row.entry_point)
        with_examples += bool(docstring_examples(row.prompt, row.entry_point))
        assert not any("check(" in t for t in tests.tests)  # never the hidden tests
        if not run_tests(tests.prefix + row.canonical_solution + "\n" + "\n".join(tests.tests)).passed:
            failing.append(row.task_id)
    assert failing == ["HumanEval/47"]
    assert with_examples >= 45


def test_the_registered_feedback_and_scorer_run_the_context_tests() -> None:
    tests = PublicTests(tests=("assert f() == 1\n",), prefix="")
    refine = build_strategy("refine", {"feedback": "public_tests"}, context={"generator": None, "public_tests": tests})
    assert isinstance(refine.feedback, ExecutionFeedback) and refine.feedback.tests == tests.tests
    bon = build_strategy("best_of_n", {"scorer": "public_tests"}, context={"generator": None, "public_tests": tests})
    assert isinstance(bon.scorer, ExecutionScorer) and bon.scorer.partial_credit
    good = Completion("def f():\n    return 1\n", (), (), "stop")
    assert bon.scorer.score("q", [good, Completion("def f():\n    return 2\n", (), (), "stop")], ledger=Ledger()) \
        == [1.0, 0.0]
    build_strategy("refine", {"feedback": "public_tests"}, context={"dry": True})  # a dry check builds nothing


def test_without_a_task_that_shows_tests_public_tests_is_refused_naming_the_parameter() -> None:
    with pytest.raises(InvalidParameter, match="feedback") as info:
        build_strategy("refine", {"feedback": "public_tests"}, context={"generator": None})
    assert "metaloom eval" in str(info.value)
    with pytest.raises(InvalidParameter, match="scorer"):
        build_strategy("best_of_n", {"scorer": "public_tests"}, context={"generator": None, "public_tests": None})


def scripted() -> ScriptedGenerator:
    """The sweeps' generator: two samples for HumanEval/0, a wrong one first, then the
    canonical solution."""
    row = load_humaneval()[0]
    question = chat_prompt(row.prompt)[0]["content"]
    return ScriptedGenerator({question: [Say(f"```python\n{row.prompt}    return True\n```"),
                                         Say(f"```python\n{row.prompt}{row.canonical_solution}```")]})


FACTORY = f"{__name__}:scripted"


def test_eval_hands_each_problem_its_own_public_tests() -> None:
    worker = Worker(Setup(task="humaneval", limit=2, factory=FACTORY))
    task = HumanEval(size=2)
    for i, problem in enumerate(task.problems()):
        built = worker.strategy(parse_spec("refine_tree@feedback=public_tests"), worker.generator, i)
        assert built.feedback.tests == task.public_tests(problem).tests
        assert problem.data["prompt"] in built.feedback.prefix
    assert task.public_tests(task.problems()[0]) != task.public_tests(task.problems()[1])


def test_best_of_n_on_humaneval_picks_the_sample_that_passes_the_examples(tmp_path) -> None:
    """Ranked by HumanEval/0's public tests, best-of-N answers with the second, right sample,
    which the hidden tests then grade correct; ranked by log-probability (a tie) it keeps the
    first, wrong one."""
    out = str(tmp_path / "he")
    sweep = plan_sweep(Setup(task="humaneval", limit=1, factory=FACTORY),
                       ["best_of_n@n=2,scorer=public_tests", "best_of_n@n=2"], out)
    run_sweep(sweep)
    with open(f"{out}/records.jsonl") as f:
        records = {r["strategy"]: r for r in map(json.loads, f)}
    assert records["best_of_n@n=2,scorer=public_tests"]["correct"]
    assert not records["best_of_n@n=2"]["correct"]


def test_metaloom_strategies_says_where_public_tests_come_from(capsys) -> None:
    from metaloom.cli import main

    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert out.count("(tests: the problem's public tests, from the task in metaloom eval)") == 2  # scorer, feedback
    assert "--feedback.tests  PublicTests" not in out
