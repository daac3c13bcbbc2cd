"""The problems of `metaloom bench remote`: held-out reasoning-gym problems (``PRESETS``, seed
``--remote-seed``), the chat every system is sent, and reasoning-gym's own judge of an answer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.errors import InvalidParameter

# name -> (reasoning-gym task, its configuration). "addition" is the configuration of the
# tests' self-consistency check (what a 135M model gets right a fair share of the time)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "addition": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                      "operators": ("+",), "allow_parentheses": False, "allow_negation": False}),
    "arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                                        "operators": ("+", "-"), "allow_parentheses": False, "allow_negation": False}),
    "gsm": ("gsm_symbolic", {}),
}
SEED = 31337  # tests/test_meta_model.py draws its problems with seed 2025
SYSTEM_PROMPT = "You are a helpful assistant. Solve the problem and give the result as a number."


@dataclass(frozen=True)
class Problem:
    index: int
    question: str
    answer: str
    entry: Mapping[str, Any] = field(repr=False, compare=False)  # reasoning-gym's entry, for its scorer


def make_problems(preset: str, size: int, seed: int) -> tuple[list[Problem], Callable[[str | None, Problem], bool]]:
    """``size`` problems of ``preset`` drawn with ``seed`` (the same every time), and a judge of
    an extracted answer: reasoning-gym's ``score_answer`` gives it full marks."""
    if preset not in PRESETS:
        raise InvalidParameter("remote_task", preset, f"one of {sorted(PRESETS)}")
    if size < 1:
        raise InvalidParameter("remote_problems", size, "an integer >= 1")
    import reasoning_gym

    task, config = PRESETS[preset]
    data = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    problems = [Problem(i, str(e["question"]), str(e["answer"]), e) for i, e in enumerate(data)]

    def correct(answer: str | None, problem: Problem) -> bool:
        return answer is not None and data.score_answer(answer, dict(problem.entry)) >= 1.0

    return problems, correct


def chat(question: str) -> tuple[dict[str, str], ...]:
    """The prompt every system is sent (optillm sends exactly this pair of messages)."""
    return ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question})
