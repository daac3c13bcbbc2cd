"""`metaloom bench search` without a model: the prompts it asks, the answers it grades, the
strategies it builds, and its summary."""

from __future__ import annotations

import pytest

from metaloom.bench.search import final_answer, grade, problems, prompt_of, strategies, summarize
from metaloom.generator.types import Completion
from metaloom.ledger import Ledger
from metaloom.score.puzzles import CountdownAnswer, CountdownSteps, Game24Answer


@pytest.mark.parametrize("task, checker", [("countdown", CountdownAnswer()), ("game24", Game24Answer())])
def test_puzzle_prompts_are_graded_on_their_own_puzzle(task, checker) -> None:
    items, data = problems(task, 3, 4242)
    for p in items:
        prompt = prompt_of(p)
        assert prompt[-1]["role"] == "user" and prompt[-2]["role"] == "assistant"  # the worked example before
        right = f"Answer: {p.entry['answer']}"
        assert checker.score(prompt, [Completion(right, (), (), "stop")], ledger=Ledger()) == [1.0]
        assert data.score_answer(final_answer(task, right), p.entry) == 1.0
        example = prompt[-2]["content"].splitlines()[-1]  # the example's answer is no answer here
        assert checker.score(prompt, [Completion(example, (), (), "stop")], ledger=Ledger()) == [0.0]


def test_the_24_game_is_graded_strictly_as_eval_grades_it() -> None:
    """reasoning-gym's puzzle24 scorer takes any four numbers that make 24; the benchmark, like
    `metaloom eval`, requires the puzzle's own."""
    items, data = problems("game24", 3, 4242)
    for p in items:
        cheat = final_answer("game24", "Answer: 6 * 4 * 1 * 1")
        assert data.score_answer(cheat, p.entry) == 1.0  # the loose scorer's verdict
        assert grade(p, data, cheat) < 1.0
        assert grade(p, data, final_answer("game24", f"Answer: {p.entry['answer']}")) == 1.0
        assert grade(p, data, None) == 0.0


def test_countdown_step_checker_reads_the_asked_puzzle() -> None:
    from metaloom.score.puzzles import reachable

    for p in problems("countdown", 4, 4242)[0]:
        a, b, c = p.entry["metadata"]["numbers"]
        target = p.entry["metadata"]["target"]
        scores = CountdownSteps().score_steps(prompt_of(p), [[f"{a} + {b} = {a + b}\n\n"], ["7 * 5 = 35\n\n"]],
                                              ledger=Ledger())
        # the numbers and target came from the puzzle, not from the worked example (5, 7, 6 -> 41)
        assert scores[0] == [1.0 if reachable([a + b, c], target, integer_only=True) else 0.0]
        assert scores[1] == [0.0] or sorted([a, b, c])[:2] == [5, 7]


def test_every_strategy_is_built_for_each_task() -> None:
    for task in ("countdown", "game24", "gsm"):
        built = {name: make() for name, make in strategies(task, object(), 8, 64).items()}
        assert {"best_of_n", "majority_vote"} <= built.keys()
        searches = [s for s in built.values() if hasattr(s, "step_scorer")]
        assert len(searches) == (18 if task == "gsm" else 9)  # judge and rollout on GSM
        assert all((s.final_scorer is None) == (task == "gsm") for s in searches)


def test_summary() -> None:
    records = [{"task": "t", "strategy": "s", "correct": c, "output_tokens": 10 * i, "input_tokens": 1, "flops": 1e12,
                "seconds": 2.0, "stopped": "budget" if i == 0 else None} for i, c in enumerate([True, False, False, True])]
    s = summarize(records)["t"]["s"]
    assert s["problems"] == 4 and s["accuracy"] == 0.5 and s["output_tokens"] == 15 and s["tflops"] == 1.0
    assert s["budget_stops"] == 1
