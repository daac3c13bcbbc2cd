"""Public tests: the examples a coding problem shows in its own docstring, as tests a
verifier may run while the hidden tests stay for grading.

HumanEval's hidden tests (``check``) are what pass@1 is graded with, so feedback or a scorer
that ran them would let the grader choose the answer. What a programmer is *shown* is the
docstring: doctest examples (``>>> f(1)`` / ``2``) in about half of the tasks and prose
examples (``f(1) == 2``, ``f(1) ➞ 2``, ``f(1) returns 2``) in most of the rest. Running those is
the "visible tests" setting of Self-Debugging (Chen et al. 2024) and AlphaCodium's public
tests, and is what `refine`, `refine_tree` and `best_of_n` get from ``public_tests`` in
`metaloom eval`.

An example is kept only when its call is a call of the task's function and its expected value
is a Python literal, both as written (the docstring's own words: a prose example that is wrong,
HumanEval/148's ``("Venus")`` for a one-element tuple, stays wrong). A problem without a usable
example gets one test that its code runs: the prompt's own stub already defines the function,
so nothing more can be checked without an example.

Of HumanEval's 164 tasks, 131 show usable examples. Three of those examples are wrong as
written, and the canonical solutions fail them: HumanEval/47 (``median`` of six numbers),
HumanEval/130 (``tri(1) = 3`` defines the sequence, it is not a call's value) and HumanEval/148.
They are kept: a verifier sees what a programmer would see.
"""

from __future__ import annotations

import ast
import doctest
import re
from dataclasses import dataclass

from metaloom.score.execution import ExecutionScorer
from metaloom.score.feedback import ExecutionFeedback

# a prose example: CALL, an arrow or words, EXPECTED (the longest call that parses is taken)
_PROSE = re.compile(r"^(?P<call>.+?\))\s*(?:#\s*)?(?:==>|=>|==|➞|->|=|returns|should return)\s*(?P<want>.+?)\s*$")
_LEAD = re.compile(r"^(?:[*\-•]\s*|for\s+|example:?\s*)+", re.IGNORECASE)

# defined before the problem's code (the prefix), so that a test, and the feedback that quotes
# it, is one readable line; its message says what the call returned
_HELPERS = ("def _expect(call, got, want):\n"
            "    if isinstance(got, float) or isinstance(want, float):\n"
            "        try:\n"
            "            same = abs(got - want) <= 1e-6 * max(1.0, abs(want))\n"
            "        except TypeError:\n"
            "            same = False\n"
            "    else:\n"
            "        same = got == want\n"
            "    assert same, f'{call} returned {got!r}, expected {want!r}'\n\n")


@dataclass(frozen=True)
class PublicTests:
    """A problem's visible tests: ``tests`` (Python sources run after ``prefix`` + the
    candidate's code, one sandbox run each) and ``prefix`` (the tests' helper, then the
    problem's own code, e.g. a HumanEval prompt, so that a candidate that only continues the
    body still runs)."""

    tests: tuple[str, ...]
    prefix: str = ""


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return True


def _parsed(text: str) -> ast.expr | None:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def _example(call: str, want: str, entry_point: str) -> tuple[str, str] | None:
    """``(call, want)`` normalised (comments and layout dropped) when ``call`` calls
    ``entry_point`` with literal arguments (``is_happy(a)`` names no value) and ``want`` is a
    literal; else None."""
    c, w = _parsed(call), _parsed(want)
    if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == entry_point):
        return None
    if not all(_literal(a) for a in [*c.args, *(k.value for k in c.keywords)]) or w is None or not _literal(w):
        return None
    return ast.unparse(c), ast.unparse(w)


def docstrings(prompt: str) -> list[str]:
    """The docstrings of ``prompt``'s functions, dedented (doctest would otherwise read a
    docstring's closing quotes as part of the last expected output); the prompt itself where
    it does not parse."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError:
        return [prompt]
    docs = [ast.get_docstring(node) for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [d for d in docs if d]


def _doctests(text: str) -> list[doctest.Example]:
    try:
        return doctest.DocTestParser().get_examples(text)
    except ValueError:  # a docstring doctest cannot read (inconsistent indentation): its prose may still serve
        return []


def docstring_examples(prompt: str, entry_point: str) -> list[tuple[str, str]]:
    """``(call, expected)`` source pairs from the doctest examples and prose examples of
    ``entry_point`` in ``prompt``'s docstrings, in order, without repeats."""
    found: list[tuple[str, str]] = []
    texts = docstrings(prompt)
    for ex in (ex for t in texts for ex in _doctests(t)):
        if (pair := _example(ex.source, ex.want, entry_point)) is not None:
            found.append(pair)
    for line in (line for t in texts for line in t.splitlines()):
        shown = _LEAD.sub("", line.strip())
        if not shown.startswith(f"{entry_point}("):
            continue
        m = _PROSE.match(shown)
        if m is None:
            continue
        # a second arrow ("-> 19 - 5 - 6 = 8") is not a value: skipped
        if (pair := _example(m.group("call"), m.group("want").rstrip("."), entry_point)) is not None:
            found.append(pair)
    unique: dict[tuple[str, str], None] = dict.fromkeys(found)
    return list(unique)


def example_test(call: str, want: str) -> str:
    """One test's source: ``call`` must equal ``want`` (floats within 1e-6 relative), and its
    assertion says what the call returned (``_expect``, defined by `PublicTests.prefix`)."""
    return f"_expect({call!r}, {call}, {want})\n"


def public_tests(prompt: str, entry_point: str) -> PublicTests:
    """The tests ``prompt`` shows for ``entry_point`` (see the module docstring)."""
    tests = tuple(example_test(c, w) for c, w in docstring_examples(prompt, entry_point))
    if not tests:
        # the prefix defines the prompt's stub, so all that can be checked without an example
        # is that the candidate's code runs (no syntax, import or top-level error)
        tests = (f"assert callable({entry_point})\n",)
    return PublicTests(tests=tests, prefix=_HELPERS + prompt)


def public_tests_feedback(tests: PublicTests) -> ExecutionFeedback:
    """Feedback from the problem's public tests (``--strategy.feedback public_tests`` in
    `metaloom eval`): the failing examples, each with what the candidate returned."""
    return ExecutionFeedback(tests=tests.tests, prefix=tests.prefix, name="public_tests")


def public_tests_scorer(tests: PublicTests) -> ExecutionScorer:
    """The fraction of the problem's public tests a candidate passes
    (``--strategy.scorer public_tests`` in `metaloom eval`)."""
    return ExecutionScorer(tests=tests.tests, prefix=tests.prefix, partial_credit=True, name="public_tests")
