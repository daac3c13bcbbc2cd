"""`metaloom.constrain.productive`: which Lark rules can finish (derive a finite string)."""

import pytest

from metaloom.constrain.productive import unfinishable


@pytest.mark.parametrize(("grammar", "stuck"), [
    ('start: "a" start', ["start"]),
    ('start: "a" start | "b"', None),
    ('start: a\na: "x" a | "y"', None),
    ('start: b\nb: "q" b\n', ["start", "b"]),
    ('start: b+\nb: b "x"', ["start", "b"]),
    ('start: b*\nb: b "x"', None),  # zero of them is a string
    ('start: [b] "z"\nb: b', None),
    ('start: (b | "k")\nb: b', None),
    ('start: (b "k")\nb: b', ["start", "b"]),
    ('start: WORD start\nWORD: /[a-z]+/', ["start"]),
    ('start: WORD ("," WORD)*\nWORD: /[a-z]+/', None),
    ('start: item~0..3 "end"\nitem: item', None),
    ('start: item~2 "end"\nitem: item', ["start", "item"]),
    ('start: x\n    | "y" start', None),  # continuation lines
    ('// a comment\nstart: "a" // trailing\n%ignore " "', None),
    ('start: NUMBER\n%import common.NUMBER', None),  # an import: assumed to finish
    ('start: %json {"type": "object"}', None),  # syntax this reader does not know: no verdict
    ('start: a -> b\na: "x"', None),
])
def test_the_rules_that_can_never_finish(grammar, stuck):
    assert unfinishable(grammar) == stuck
