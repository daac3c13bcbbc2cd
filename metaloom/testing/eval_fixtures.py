"""Generator factories for `metaloom eval` tests (``Setup(factory="metaloom.testing.eval_fixtures:NAME")``).

A sweep builds its generator in each worker process, from a ``"module:function"`` name, so
these live in an importable module rather than in a test file: a Ray worker imports them
the same way the driver does.

`arithmetic` answers every "What is A+B?" prompt with "The answer is C." Hooks in a
problem's text script faults a test needs, deterministically and from the data alone (a
worker's environment is fixed when its cluster starts, the problem text travels with the job):

- ``die-once:PATH``: the first worker process to see the prompt creates PATH and exits at
  once (``os._exit``: no exception, no cleanup, as a killed process); later ones answer;
- ``die-always``: every worker process that sees the prompt exits (a job no retry saves);
- ``wait-for:PATH``: wait until PATH exists (at most `WAIT_SECONDS`) before answering; an
  answer after the wait ran out is "The answer is unknown." (so a test sees that it did);
- ``log-draws:PATH``: every request with this prompt that reaches the generator (a sample
  pool replayed to a later strategy does not) appends a line ``PID PROMPT`` to PATH.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence

from metaloom.errors import ModelNotFound
from metaloom.generator.types import Completion, Request
from metaloom.ledger import Ledger
from metaloom.testing.scripted import Say, ScriptedGenerator

WAIT_SECONDS = 30.0
_SUM = re.compile(r"What is\s+(-?\d+)\s*([-+*])\s*(-?\d+)")
_DIE_ONCE = re.compile(r"die-once:(\S+)")
_WAIT_FOR = re.compile(r"wait-for:(\S+)")
_LOG_DRAWS = re.compile(r"log-draws:(\S+)")


def solve(text: str) -> str:
    """The scripted answer to a prompt: its sum, difference or product, or "unknown"."""
    m = _SUM.search(text)
    if m is None:
        return "The answer is unknown."
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"The answer is {value}."


def _die_once(text: str) -> None:
    if "die-always" in text:
        os._exit(1)
    m = _DIE_ONCE.search(text)
    if m is None:
        return
    try:
        fd = os.open(m.group(1), os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: one process dies
    except FileExistsError:
        return
    os.close(fd)
    os._exit(1)


def _waited(text: str) -> bool:
    """False when a ``wait-for`` file did not appear in time."""
    m = _WAIT_FOR.search(text)
    if m is None:
        return True
    deadline = time.monotonic() + WAIT_SECONDS
    while not os.path.exists(m.group(1)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class ArithmeticScript(ScriptedGenerator):
    """A `ScriptedGenerator` whose table fills itself: a prompt it has not seen gets the
    scripted answer (`solve`), after the prompt's hooks ran."""

    def __init__(self) -> None:
        super().__init__({})

    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        for r in requests:
            m = _LOG_DRAWS.search(r.prompt) if isinstance(r.prompt, str) else None
            if m is not None:
                with open(m.group(1), "a") as f:  # one short write per line: appends do not interleave
                    f.write(f"{os.getpid()} {r.prompt}\n")
        return super().generate(requests, ledger=ledger)

    def _lookup(self, text: str, n: int) -> list[tuple[str, int, str]]:
        if text not in self.table:
            _die_once(text)
            answer = solve(text) if _waited(text) else "The answer is unknown."
            self.table[text] = [Say(answer)]
            self.cursor[text] = 0
        return super()._lookup(text, n)


def arithmetic() -> ArithmeticScript:
    return ArithmeticScript()


def missing_model() -> ScriptedGenerator:
    """A factory that fails the way a bad model path does (a typed error building the worker)."""
    raise ModelNotFound("no model at /nonexistent/model (eval_fixtures.missing_model)")


def problems_file(path: str, questions: Sequence[tuple[str, str]]) -> str:
    """Write ``(prompt, answer)`` pairs as a JSON Lines task file; returns ``jsonl:PATH``."""
    import json

    with open(path, "w") as f:
        for prompt, answer in questions:
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    return f"jsonl:{path}"
