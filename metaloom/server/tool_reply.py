"""Function calling's reply: the calls a model's output makes, as a client may use them.

A reply is text or ``<tool_call>`` blocks (`metaloom.server.tools` says how the prompt asks for
them and the grammar holds them to it). Only whole blocks are calls: a call cut short by
``max_tokens`` is never returned, and call markup is never content. A model that repeats a call
it made (greedy decoding does, until ``max_tokens``) is read as done: each distinct call is
returned once, and the server ends the row (`Calls.repeated`). `parse` and `message` read a
finished reply; `ToolStream` turns a streamed one into OpenAI's deltas, each call whole once its
block is closed, so streamed and non-streamed replies hold the same calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from metaloom.server.tools import CLOSE, OPEN


@dataclass
class Partial:
    """What a (possibly unfinished) reply holds so far: ``content`` (text that is surely not a
    call), and each call's name (None until its closing quote) and arguments text so far;
    ``closed``: how many of the calls are whole blocks (``</tool_call>`` written);
    ``complete``: every call block is closed and nothing else follows."""

    content: str = ""
    calls: list[tuple[str | None, str]] = field(default_factory=list)
    closed: int = 0
    complete: bool = False


def _object_end(text: str) -> int | None:
    """The index just past the JSON object that starts ``text`` (None: not closed yet)."""
    depth, quoted, escaped = 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


HEAD = re.compile(r'<tool_call>\n\{"name": "((?:[^"\\]|\\.)*)"(, "arguments": )?')


def partial(text: str) -> Partial:
    """Read a reply so far (see `Partial`). Text that is a prefix of ``<tool_call>`` is neither
    content nor a call yet; text that starts otherwise is all content."""
    if not text.startswith(OPEN):
        return Partial(content="" if OPEN.startswith(text) else text)
    out, at = Partial(), 0
    while True:
        head = HEAD.match(text, at)
        if head is None:
            return out  # inside the block's opening
        name = json.loads(f'"{head.group(1)}"')
        if head.group(2) is None:  # the name is closed, its arguments not begun
            out.calls.append((name, ""))
            return out
        args_start = head.end()
        end = _object_end(text[args_start:])
        if end is None:
            out.calls.append((name, text[args_start:]))
            return out
        out.calls.append((name, text[args_start:args_start + end]))
        at = args_start + end
        closing = "}\n" + CLOSE
        if not text.startswith(closing, at):
            return out
        at += len(closing)
        out.closed += 1
        if at == len(text):
            out.complete = True
            return out
        if not text.startswith("\n", at):
            return out
        at += 1


@dataclass
class Calls:
    """The calls a reply makes, as a client may use them: only whole blocks (a call cut short by
    ``max_tokens`` never appears as a call), each distinct call once (``repeated``: the reply
    went on to repeat one, which a greedy model does until ``max_tokens``: the row may end
    there), and ``content`` when the reply is text. No call markup is ever content."""

    content: str | None
    calls: list[tuple[str, str]]
    repeated: bool = False
    cut: bool = False  # a call was begun and not finished

    @classmethod
    def read(cls, text: str, final: bool = True) -> Calls:
        """The calls of ``text`` (``final``: the whole reply; else the reply so far, whose
        content may still become a call's opening)."""
        p = partial(text)
        if not text.startswith(OPEN):
            return cls(p.content if not final else text, [])
        calls: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        repeated = False
        for name, args in p.calls[:p.closed]:
            try:
                canonical = json.dumps(json.loads(args), ensure_ascii=False)
            except json.JSONDecodeError:  # the grammar makes it JSON: a block that is not is not a call
                break
            key = (str(name), canonical)
            if key in seen:
                repeated = True
                break
            seen.add(key)
            calls.append(key)
        return cls(None, calls, repeated, cut=not repeated and not p.complete and final)


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A finished reply as (content, [(name, arguments JSON text)]) (see `Calls`): calls when
    it holds whole call blocks, content when it is text; a reply that began a call and never
    finished one has neither (its markup is no answer)."""
    read = Calls.read(text)
    if read.calls:
        return None, read.calls
    return (read.content if read.content is not None else ""), []


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message(text: str) -> tuple[dict[str, Any], bool]:
    """A finished reply as OpenAI's assistant message, and whether it calls functions."""
    content, calls = parse(text)
    if not calls:
        return {"role": "assistant", "content": content}, False
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}}
                           for n, a in calls]}, True


def finish_reason(text: str, engine: str) -> str:
    """OpenAI's finish reason of a reply that may call functions: ``tool_calls`` when it calls
    and ended (a repeated call ends it too), the engine's own reason otherwise (``length``: a
    call may have been cut; the whole ones are still returned)."""
    read = Calls.read(text)
    if read.calls and (engine == "stop" or read.repeated):
        return "tool_calls"
    return engine


class ToolStream:
    """One streamed choice's reply as OpenAI's chat deltas: ``feed(text)`` each new piece and
    get the deltas it allows. Content streams as it comes; a call is sent whole (its id, name
    and arguments in one delta) once its block is closed, so a cut or repeated call is never
    sent: streamed and non-streamed replies hold the same calls. `repeated` says the reply
    began repeating a call (the caller may end the row); `calls` whether it called."""

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.sent = 0  # calls sent
        self.repeated = False
        self.deltas: list[dict[str, Any]] = []  # what the last feed gave (the server keeps it here)

    @property
    def calls(self) -> bool:
        return self.sent > 0

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.repeated:
            return []
        read = Calls.read(self.text, final=False)
        out: list[dict[str, Any]] = []
        if read.content is not None and len(read.content) > self.content_sent:
            out.append({"content": read.content[self.content_sent:]})
            self.content_sent = len(read.content)
        for index in range(self.sent, len(read.calls)):
            name, args = read.calls[index]
            out.append({"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                                        "function": {"name": name, "arguments": args}}]})
        self.sent = len(read.calls)
        self.repeated = read.repeated
        return out

    def finish(self) -> list[dict[str, Any]]:
        """At the end: text held back as a possible call opening that never became one."""
        if not self.text.startswith(OPEN) and self.content_sent < len(self.text):
            rest = self.text[self.content_sent:]
            self.content_sent = len(self.text)
            return [{"content": rest}]
        return []
