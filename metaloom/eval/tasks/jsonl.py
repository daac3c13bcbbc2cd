"""A user's own problems: ``jsonl:PATH``, one JSON object per line.

Fields of a line:

- ``prompt`` (required): a string (sent as it is, no chat template), or chat messages
  ``[{"role": ..., "content": ...}, ...]`` (roles system, user, assistant; at least one user
  message);
- ``answer``: the expected answer, graded by an extractor's equivalence (``extractor``: a name
  from `metaloom.wiring.registry.EXTRACTORS` that needs no arguments; default ``math``): the
  extracted answer of the output is ``same`` as the extracted answer (or, where it extracts
  none, the text) of ``answer``;
- ``scorer``: instead, a grader by name: ``exact`` (the whole output, whitespace collapsed,
  equals ``answer``, which it then needs) or the registered exact puzzle checkers
  ``countdown`` / ``game24`` (which read the numbers from the prompt's last user message;
  ``answer`` is then only the reference shown in reports);
- ``id``: a string or integer unique in the file (default: the line number);
- ``metadata``: anything, kept out of the way (any other field is an error, so that a
  misspelt ``extractor`` is not silently graded with ``math``).

Blank lines are skipped; line numbers count every line. Every mistake is an `InvalidParameter`
naming the file and the line. ``--limit N`` takes the first N problems (the whole file is still
checked); the seed is unused. The configuration holds the file's sha256, so a sweep notices a
changed file.

Voting extractor: the one every line grades with (``exact`` lines vote with ``exact``, puzzle
lines with ``puzzle_expression``); a file whose lines grade with different ones has none, and
`JsonlTask.extractor` says so (a voting strategy then needs an explicit extractor).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.tasks.base import Grade, Problem
from metaloom.generator.types import Completion, Message
from metaloom.ledger import Ledger
from metaloom.score.answers import ExactString, Extractor
from metaloom.score.protocols import Prompt, Raw, Scorer
from metaloom.score.puzzles import PuzzleExpression

FIELDS = ("prompt", "answer", "extractor", "scorer", "id", "metadata")
ROLES = ("system", "user", "assistant")
DEFAULT_EXTRACTOR = "math"
PUZZLE_SCORERS = ("countdown", "game24")  # registered scorers that grade from the prompt alone
SCORERS = ("exact", *PUZZLE_SCORERS)
_SHOWN = 120


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _bad(path: str, line: int, what: str, value: Any, allowed: str) -> InvalidParameter:
    return InvalidParameter(f"{path} line {line}: {what}", value, allowed)


@functools.cache
def usable_extractors() -> dict[str, Extractor]:
    """The registered extractors a line can name: those built without arguments
    (``code_tests`` needs tests, so it is not one)."""
    from metaloom.wiring.registry import EXTRACTORS, resolve

    out = {}
    for name, entry in EXTRACTORS.items():
        try:
            out[name] = resolve(entry)()
        except TypeError:
            continue
    return out


def _puzzle_scorer(name: str) -> Scorer:
    from metaloom.wiring.registry import SCORERS as REGISTERED
    from metaloom.wiring.registry import lookup

    return lookup("scorer", REGISTERED, name)()


@dataclass(frozen=True)
class Grader:
    """How one line is graded: ``kind`` "extractor" (``name`` an extractor, against
    ``answer``) or "scorer" (``name`` one of `SCORERS`)."""

    kind: str
    name: str
    answer: str | None

    @property
    def vote_extractor(self) -> str:
        """The extractor name a vote on this line uses."""
        if self.kind == "extractor":
            return self.name
        return "exact" if self.name == "exact" else PuzzleExpression.name

    def grade(self, prompt: Prompt, text: str) -> Grade:
        if self.kind == "scorer" and self.name in PUZZLE_SCORERS:
            score = _puzzle_scorer(self.name).score(prompt, [Completion(text, (), (), "stop")], ledger=Ledger())[0]
            return Grade(answer=PuzzleExpression().extract(text), correct=score >= 1.0, score=float(score))
        extractor = ExactString() if self.kind == "scorer" else usable_extractors()[self.name]
        assert self.answer is not None  # checked when the line was read
        got = extractor.extract(text)
        expected = extractor.extract(self.answer) or self.answer
        correct = got is not None and extractor.same(got, expected)
        return Grade(answer=got, correct=correct, score=1.0 if correct else 0.0)


def _prompt(path: str, line: int, value: Any) -> Prompt:
    """A line's prompt: a non-empty string (raw text, no chat template), or chat messages with at
    least one user message."""
    allowed = f"a non-empty string or a list of {{'role', 'content'}} messages (roles {list(ROLES)}) with a user message"
    if isinstance(value, str) and value.strip():
        return Raw(value)  # sent as it is (no chat template): a strategy reads a plain str as chat
    if not isinstance(value, list) or not value:
        raise _bad(path, line, "prompt", value, allowed)
    messages: list[Message] = []
    for m in value:
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
                and isinstance(m["content"], str)):
            raise _bad(path, line, "prompt message", m, allowed)
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in messages):
        raise _bad(path, line, "prompt", value, allowed)
    return tuple(messages)


def _answer(path: str, line: int, row: Mapping[str, Any]) -> str | None:
    value = row.get("answer")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float) or not str(value).strip():
        raise _bad(path, line, "answer", value, "a non-empty string or a number")
    return str(value)


def _grader(path: str, line: int, row: Mapping[str, Any], prompt: Prompt) -> Grader:
    """How the line is graded, every name checked (a puzzle scorer must find its puzzle in the
    prompt now, not at the first grade)."""
    answer = _answer(path, line, row)
    scorer = row.get("scorer")
    if scorer is None:
        if answer is None:
            raise _bad(path, line, "answer", None, f"an 'answer' (graded by an extractor) or a 'scorer' {list(SCORERS)}")
        name = row.get("extractor", DEFAULT_EXTRACTOR)
        if name not in usable_extractors():
            raise _bad(path, line, "extractor", name, f"one of {sorted(usable_extractors())}")
        return Grader("extractor", name, answer)
    if "extractor" in row:
        raise _bad(path, line, "extractor", row["extractor"], f"no extractor beside scorer {scorer!r} (the scorer grades)")
    if scorer not in SCORERS:
        raise _bad(path, line, "scorer", scorer, f"one of {list(SCORERS)}")
    if scorer == "exact" and answer is None:
        raise _bad(path, line, "answer", None, "an 'answer' for scorer 'exact' to compare with")
    grader = Grader("scorer", scorer, answer)
    if scorer in PUZZLE_SCORERS:
        try:
            grader.grade(prompt, "")
        except InvalidParameter as exc:
            raise _bad(path, line, "prompt", _shown(str(prompt)), f"a {scorer} puzzle for scorer {scorer!r} ({exc})") from exc
    return grader


def _id(path: str, line: int, row: Mapping[str, Any]) -> str:
    value = row.get("id", line)
    if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
        raise _bad(path, line, "id", value, "a non-empty string or an integer")
    return str(value)


def _problem(path: str, line: int, text: str) -> Problem:
    """One line as a problem (`InvalidParameter` naming the line for anything amiss)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(path, line, "JSON", _shown(text), f"one JSON object per line ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(row, dict):
        raise _bad(path, line, "JSON", _shown(text), "a JSON object")
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:
        raise _bad(path, line, "field", unknown[0], f"the fields {list(FIELDS)}")
    if "prompt" not in row:
        raise _bad(path, line, "prompt", None, "a 'prompt' (a string or chat messages)")
    prompt = _prompt(path, line, row["prompt"])
    grader = _grader(path, line, row, prompt)
    return Problem(id=_id(path, line, row), prompt=prompt, reference=grader.answer,
                   data={"line": line, **dataclasses.asdict(grader)})


def _grader_of(problem: Problem) -> Grader:
    return Grader(problem.data["kind"], problem.data["name"], problem.data["answer"])


def _read(path: str) -> tuple[bytes, list[str]]:
    """The file's bytes and its lines as text."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise InvalidParameter("task", f"jsonl:{path}", f"a readable JSON Lines file ({exc.strerror or exc})") from exc
    try:
        return raw, raw.decode("utf-8-sig").split("\n")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise _bad(path, line, "text", _shown(repr(raw.split(b"\n")[line - 1])), "UTF-8 text") from exc


def read_problems(path: str) -> tuple[str, tuple[Problem, ...]]:
    """The file's sha256 and all its problems, in file order."""
    raw, lines = _read(path)
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        p = _problem(path, number, text)
        if p.id in seen:
            raise _bad(path, number, "id", p.id, f"ids unique in the file (line {seen[p.id]} has it too)")
        seen[p.id] = number
        problems.append(p)
    if not problems:
        raise InvalidParameter("task", f"jsonl:{path}", f"a file with at least one problem (its {len(lines)} "
                                                        "line(s) are blank)")
    return hashlib.sha256(raw).hexdigest(), tuple(problems)


@dataclass(frozen=True)
class JsonlTask:
    """The problems of a JSON Lines file (`load_jsonl`): ``path`` as given, ``sha256`` of the
    whole file, ``items`` the problems taken."""

    path: str
    sha256: str
    items: tuple[Problem, ...]

    @property
    def name(self) -> str:
        return f"jsonl:{self.path}"

    def config(self) -> dict[str, Any]:
        return {"task": self.name, "dataset": "jsonl", "path": self.path, "sha256": self.sha256, "size": len(self.items)}

    def problems(self) -> Sequence[Problem]:
        return self.items

    def extractor(self) -> Extractor:
        """The extractor every problem grades with (see the module docstring)."""
        names = sorted({_grader_of(p).vote_extractor for p in self.items})
        if len(names) > 1:
            raise InvalidParameter(f"{self.path} extractor", names,
                                   "one extractor for the whole file to vote with: give every line the same one, "
                                   "or name the strategy's extractor")
        return PuzzleExpression() if names[0] == PuzzleExpression.name else usable_extractors()[names[0]]

    def public_tests(self, problem: Problem) -> None:
        return None  # a line's tests, where it has them, are what it is graded with

    def grade(self, problem: Problem, text: str) -> Grade:
        return _grader_of(problem).grade(problem.prompt, text)


def load_jsonl(path: str, *, limit: int | None = None) -> JsonlTask:
    """The first ``limit`` problems of the file (None: all), read and checked now, so a bad
    file fails before any model runs."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidParameter("limit", limit, "an integer >= 1, or None for the whole file")
    digest, problems = read_problems(path)
    return JsonlTask(path, digest, problems[:limit])
