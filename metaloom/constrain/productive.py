"""Whether a Lark grammar can finish: the rules that derive some finite string (the productive
ones, the textbook fixed point), so that ``start: "a" start`` — a rule every alternative of
which needs itself again — is an `InvalidGrammar` before any model call. llguidance accepts
such a grammar, allows its first tokens, and then fails in the middle of a generation.

A rule is productive when one of its alternatives is: a sequence all of whose items are
(strings and regular expressions are; a name is when its rule or terminal is; ``x?``, ``x*``,
``[x]`` and ``x~0..n`` always are; ``x+`` and a group when their content is). This reads the
Lark dialect's plain syntax; where it meets something it does not know (llguidance's ``%json``,
``@grammar`` references, special tokens, an import) it takes that part to be productive, and a
grammar it cannot read at all is left to llguidance: the check only ever refuses what surely
cannot finish.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r'''
    (?P<ws>\s+)
  | (?P<string>"(?:\\.|[^"\\])*"i?)
  | (?P<regex>/(?:\\.|[^/\\])+/[imslux]*)
  | (?P<repeat>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[()\[\]|?*+])
''', re.VERBOSE)
_RULE = re.compile(r"^(?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]]*\])?(?:\.\d+)?\s*:(?P<body>.*)$")


class _Unknown(Exception):
    """Syntax this reader does not know: no verdict."""


def rules(grammar: str) -> dict[str, str] | None:
    """Each rule's (or terminal's) expansion text, by name; None where the grammar has lines
    this reader does not know."""
    out: dict[str, str] = {}
    current: str | None = None
    for raw in grammar.splitlines():
        line = re.sub(r"//.*$", "", raw).rstrip()
        if not line.strip() or line.lstrip().startswith("%"):
            current = None if not line.strip() else current
            continue
        m = _RULE.match(line)
        if m and not line[0].isspace():
            current = m["name"].lstrip("?!")
            out[current] = m["body"]
        elif current is not None and line.lstrip().startswith("|"):
            out[current] += " " + line
        else:
            return None
    return out


def _tokens(text: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            raise _Unknown(text[at:at + 10])
        at = m.end()
        if m.lastgroup != "ws":
            out.append((str(m.lastgroup), m.group()))
    return out


def _productive(tokens: list[tuple[str, str]], known: set[str], defined: set[str]) -> bool:
    """Whether the alternatives in ``tokens`` derive a finite string, given the names in ``known``."""
    pos = 0

    def alternatives() -> bool:
        nonlocal pos
        ok = sequence()
        while pos < len(tokens) and tokens[pos] == ("punct", "|"):
            pos += 1
            ok = sequence() or ok
        return ok

    def sequence() -> bool:
        nonlocal pos
        ok = True
        while pos < len(tokens) and tokens[pos][1] not in ("|", ")", "]"):
            ok = item() and ok
        return ok

    def item() -> bool:
        nonlocal pos
        kind, text = tokens[pos]
        pos += 1
        if kind in ("string", "regex"):
            ok = True
        elif kind == "name":
            name = text.lstrip("?!")
            ok = name in known or name not in defined  # an imported or built-in name: assumed productive
        elif text == "(":
            ok = alternatives()
            _expect(")")
        elif text == "[":
            alternatives()
            _expect("]")
            ok = True
        else:
            raise _Unknown(text)
        if (pos < len(tokens) and tokens[pos][1] in ("?", "*", "+")) or (pos < len(tokens) and tokens[pos][0] == "repeat"):
            kind, text = tokens[pos]
            pos += 1
            if text in ("?", "*") or (kind == "repeat" and re.match(r"~\s*0\b", text)):
                ok = True
        return ok

    def _expect(close: str) -> None:
        nonlocal pos
        if pos >= len(tokens) or tokens[pos][1] != close:
            raise _Unknown(f"expected {close}")
        pos += 1

    ok = alternatives()
    if pos != len(tokens):
        raise _Unknown("trailing input")
    return ok


def unfinishable(grammar: str, start: str = "start") -> list[str] | None:
    """The rules that can never finish when ``start`` is one of them (start first), else None;
    None too where the grammar cannot be read here (no verdict)."""
    table = rules(grammar)
    if not table or start not in table:
        return None
    try:
        parsed = {name: _tokens(body) for name, body in table.items()}
        defined, known = set(parsed), set[str]()
        changed = True
        while changed:
            changed = False
            for name, tokens in parsed.items():
                if name not in known and _productive(tokens, known, defined):
                    known.add(name)
                    changed = True
    except _Unknown:
        return None
    if start in known:
        return None
    return [start, *sorted(n for n in parsed if n not in known and n != start)]
