"""What an evaluation task is: problems (each a prompt and what its grader needs), an answer
extractor that strategies vote with, and a grader of a completion's text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from metaloom.score.answers import Extractor
from metaloom.score.protocols import Prompt

if TYPE_CHECKING:
    from metaloom.score.public_tests import PublicTests


@dataclass(frozen=True)
class Problem:
    """One problem. ``id``: stable within the task and its configuration (records are keyed by
    it, so a resumed sweep finds them); ``prompt``: what the strategy is run on (chat messages
    or raw text); ``reference``: the expected answer as a person reads it (for the report;
    None when there is none, e.g. code graded by tests); ``data``: what the grader needs."""

    id: str
    prompt: Prompt
    reference: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grade:
    """A graded output: ``answer`` as extracted (None: none found), ``correct``, and ``score``
    in [0, 1] (the grader's own partial credit where it has one; 1.0 or 0.0 otherwise)."""

    answer: str | None
    correct: bool
    score: float


@runtime_checkable
class Task(Protocol):
    @property
    def name(self) -> str:
        """The task name as given on the command line (``countdown``, ``jsonl:PATH``, ...)."""
        ...

    def config(self) -> dict[str, Any]:
        """The task's identity as JSON (name, dataset, size, seed, file hash, ...): a sweep's
        ``--out`` directory records it and refuses a different one."""
        ...

    def problems(self) -> Sequence[Problem]:
        ...

    def extractor(self) -> Extractor:
        """The extractor strategies vote with on this task (set on a strategy that takes one
        and whose spec names none)."""
        ...

    def grade(self, problem: Problem, text: str) -> Grade:
        """Grade an output text (a strategy's chosen output, or one candidate)."""
        ...

    def public_tests(self, problem: Problem) -> PublicTests | None:
        """The tests ``problem`` shows, which a verifier may run (``public_tests`` feedback and
        scorer: `metaloom.score.public_tests`), as against the hidden ones it is graded with;
        None where the task shows none."""
        ...
